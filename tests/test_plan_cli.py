"""`dynmo-hpc plan`: argument parsing and the JSON it prints (called in-process, no subprocess)."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from dynmo_hpc.cli import plan as plan_cli


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="dynmo-hpc")
    plan_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_optimal_plan_prints_boundaries_and_stage_loads(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(["--costs", "0,1,2,3,3,3", "--stages", "4"], capsys)
    assert rc == 0 and err == ""
    result = json.loads(out)
    assert result["algorithm"] == "optimal"
    assert result["parts"] == [0, 3, 4, 5, 6]
    assert result["stage_loads"] == [3.0, 3.0, 3.0, 3.0]
    assert result["bottleneck"] == result["optimal_bottleneck"] == 3.0


@pytest.mark.parametrize(
    ("algorithm", "extra", "parts"),
    [
        ("uniform", [], [0, 1, 2, 4]),
        ("diffusion", [], [0, 1, 2, 4]),
        ("optimal", [], [0, 2, 3, 4]),
        ("parameters", ["--params", "1,1,1,5"], [0, 2, 3, 4]),
    ],
)
def test_each_algorithm_is_selectable(
    algorithm: str, extra: list[str], parts: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = _run(
        ["--costs", "0,1,1,1", "--stages", "3", "--algorithm", algorithm, *extra], capsys
    )
    assert rc == 0
    result = json.loads(out)
    assert result["parts"] == parts and result["optimal_bottleneck"] == 1.0


def test_capacity_and_memory_are_reported(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--costs", "1,1,1,1", "--stages", "2", "--memory", "1,1,1,3", "--capacity", "3"]
    rc, out, _ = _run(argv, capsys)
    result = json.loads(out)
    assert rc == 0 and result["parts"] == [0, 3, 4]
    assert result["stage_memory"] == [3.0, 3.0]


def test_current_is_kept_when_optimal_and_moves_are_counted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, out, _ = _run(["--costs", "1,1,1,1", "--stages", "2", "--current", "0,2,4"], capsys)
    assert rc == 0 and json.loads(out)["num_moves"] == 0
    rc, out, _ = _run(["--costs", "1,1,1,1", "--stages", "2", "--current", "0,1,4"], capsys)
    result = json.loads(out)
    assert result["parts"] == [0, 2, 4] and result["num_moves"] == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--costs", "1,1", "--stages", "4"], "num_stages=4 > number of layers=2"),
        (
            ["--costs", "1,1,1,1", "--stages", "2", "--memory", "1,1,1,3", "--capacity", "2"],
            "need at least 3 bytes per stage",
        ),
        (["--costs", "1,-1", "--stages", "1"], r"costs\[1\]=-1.0 is invalid"),
        (["--costs", "1,1", "--stages", "1", "--algorithm", "uniform", "--capacity", "3"], "valid"),
        (
            ["--costs", "1,1", "--stages", "1", "--algorithm", "parameters"],
            r"'parameters' needs option\(s\) params",
        ),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1
    assert re.search(message, err)


def test_malformed_list_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        _run(["--costs", "1,x", "--stages", "1"], capsys)
    assert excinfo.value.code == 2
    assert "comma-separated numbers" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--costs", "", "--stages", "1"], r"costs is empty"),
        (["--costs", ",", "--stages", "1"], r"costs is empty"),
        (["--costs", "nan,1", "--stages", "1"], r"costs\[0\]=nan is invalid"),
        (["--costs", "1,inf", "--stages", "1"], r"costs\[1\]=inf is invalid"),
        (["--costs", "1e400,1", "--stages", "1"], r"costs\[0\]=inf is invalid"),
        (["--costs", "1,-2", "--stages", "1"], r"costs\[1\]=-2.0 is invalid"),
        (["--costs", "1e308,1e308", "--stages", "1"], r"the sum of the costs overflows"),
        (["--costs", "1,1", "--stages", "0"], r"num_stages=0 must be >= 1"),
        (["--costs", "1,1", "--stages", "-3"], r"num_stages=-3 must be >= 1"),
        (["--costs", "1,1", "--stages", "3"], r"num_stages=3 > number of layers=2"),
        (["--costs", "1,1", "--stages", "1.5"], r"argument --stages: invalid int value: '1.5'"),
        (["--costs", "1,x", "--stages", "1"], r"argument --costs: expected comma-separated"),
        (["--costs", "1,1", "--stages", "1", "--algorithm", "best"], r"invalid choice: 'best'"),
        (["--costs", "1,1", "--stages", "1", "--capacity", "5"], r"must be given together"),
        (["--costs", "1,1", "--stages", "1", "--memory", "1,1"], r"must be given together"),
        (["--costs", "1,1", "--stages", "1", "--memory", "1,1", "--capacity", "nan"], r"capacity"),
        (["--costs", "1,1", "--stages", "1", "--memory", "1,1", "--capacity", "-1"], r"capacity"),
        (["--costs", "1,1", "--stages", "1", "--memory", "1", "--capacity", "5"], r"1 entries"),
        (
            ["--costs", "1,1", "--stages", "1", "--memory", "", "--capacity", "5"],
            r"memory is empty",
        ),
        (["--costs", "1,1", "--stages", "1", "--memory", "1,nan", "--capacity", "5"], r"nan"),
        (["--costs", "1,1", "--stages", "1", "--memory", "1,-1", "--capacity", "5"], r"-1.0"),
        (["--costs", "1,1", "--stages", "1", "--algorithm", "parameters", "--params", "1"], "1 e"),
        (
            ["--costs", "1,1", "--stages", "1", "--algorithm", "parameters", "--params", "1,-4"],
            "-4",
        ),
        (["--costs", "1,1", "--stages", "2", "--current", "0,1"], r"must start at 0 and end at"),
        (["--costs", "1,1", "--stages", "2", "--current", "0,5,2"], r"empty or reversed"),
        (["--costs", "1,1", "--stages", "2", "--current", ""], r"needs at least two boundaries"),
        (["--costs", "1,1", "--stages", "2", "--current", "0,a,2"], r"comma-separated whole"),
        (
            ["--costs", "1,1", "--stages", "2", "--algorithm", "diffusion", "--max-rounds", "-1"],
            r"max_rounds=-1 must be >= 0",
        ),
        (["--costs", "1,1", "--stages", "2", "--max-rounds", "3"], r"does not take option"),
    ],
)
def test_every_bad_plan_input_is_one_error_line_through_the_cli(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through ``dynmo-hpc``'s own parser: usage errors too are one line with a HINT, exit 2."""
    from dynmo_hpc.cli import main

    try:
        rc = main(["plan", *argv])
    except SystemExit as exc:  # argparse's usage errors exit from inside parse_args
        rc = exc.code
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "HINT:" in err and "Traceback" not in err
    assert re.search(message, err), err
