"""The output files of the ``benchmarks/*.py`` scripts (``dynmo_hpc.bench.scripts``): written
whole, with the bytes each script wrote before, and not at all when the flag is absent.
``run_rank_program`` is run by the smoke tests of the scripts that use it
(``tests/test_bench_smoke.py``: bench_duplex.py, profile_migration.py;
``tests/test_bench_migration.py``)."""

from __future__ import annotations

import json
from pathlib import Path

from dynmo_hpc.bench.scripts import write_json_out, write_text_out


def test_json_bytes_follow_the_indent_and_newline_asked_for(tmp_path: Path) -> None:
    value = {"rows": [{"a": 1.5}], "steps": 3}
    write_json_out(tmp_path / "default.json", value)
    assert (tmp_path / "default.json").read_text() == json.dumps(value, indent=1) + "\n"
    write_json_out(tmp_path / "compact.json", value, indent=None, newline=False)
    assert (tmp_path / "compact.json").read_text() == json.dumps(value)


def test_no_path_writes_nothing_and_a_missing_directory_is_created(tmp_path: Path) -> None:
    write_json_out(None, {"a": 1})
    write_text_out(None, "table")
    assert list(tmp_path.iterdir()) == []
    target = tmp_path / "new" / "dir" / "table.md"
    write_text_out(target, "| a |\n")
    assert target.read_text() == "| a |\n"
    assert [p.name for p in target.parent.iterdir()] == ["table.md"]  # no temporary left
