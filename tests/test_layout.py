"""The package layout's rules, checked from the source: imports form a DAG, between modules and
between subpackages; nothing outside the CLI imports it; the in-allocation manager never loads
argparse; modules stay small; and a wheel built from the repository carries the sbatch template
and renders a script.

The subpackages are layered, each importing only from the layers below it (a package-level cycle,
``X`` importing ``Y`` while ``Y`` imports ``X`` at any depth, fails
:func:`test_subpackages_form_a_dag`):

1. the top-level modules (``errors``, ``version``, ``atomic_io``, ``logging_utils``,
   ``isolation``, ``report_cycle``, ``placement``);
2. ``config``;
3. ``balance``, ``model``, ``runlog``, ``handoff`` (what a rank and its launcher exchange),
   ``data`` (corpus and batches), ``testing`` (machinery only the tests switch on);
4. ``pipeline`` (the engine on every rank: stage, schedule, links, migration);
5. ``checkpoint`` (writing, lineage, resume);
6. ``train`` (the step loop, load reports, rank 0's decisions);
7. ``launch`` (starting ranks locally, the supervisor every launcher shares), ``sim``,
   ``calibrate`` (the simulator's fitted rates), ``bench``;
8. ``slurm`` (the SLURM backend, its in-allocation manager and submission, built on ``launch``);
9. ``cli``, then the package root and ``__main__``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT

PACKAGE = ROOT / "dynmo_hpc"
MAX_MODULE_LINES = 600


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every dynmo_hpc module ``path`` imports, at any depth (functions, TYPE_CHECKING too).

    ``from a.b import c`` counts as importing ``a.b.c`` when that is a module, else ``a.b``.
    Relative imports are resolved against the importing module's package.
    """
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    found.add(sub)
                elif base in modules:
                    found.add(base)
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) for name, path in modules.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_imports_form_a_dag() -> None:
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _package_of(module: str) -> str:
    """``dynmo_hpc.X`` for any module inside subpackage ``X``; a top-level module is its own."""
    parts = module.split(".")
    if len(parts) >= 2 and (PACKAGE / parts[1]).is_dir():
        return ".".join(parts[:2])
    return module


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph collapsed to packages: an edge ``X -> Y`` when a module of ``X`` imports
    one of ``Y`` (imports inside a package are dropped)."""
    packages: dict[str, set[str]] = {_package_of(name): set() for name in graph}
    for name, deps in graph.items():
        source = _package_of(name)
        packages[source].update(p for d in deps if (p := _package_of(d)) != source)
    return packages


def test_subpackages_form_a_dag() -> None:
    cycle = _find_cycle(_package_graph(_graph()))
    assert cycle is None, (
        "import cycle between subpackages: "
        + " -> ".join(cycle or [])
        + "; HINT: move what both need into the lower layer (see this module's docstring)"
    )


def test_package_graph_finds_a_cycle_through_submodules() -> None:
    """The checker itself: modules that form no cycle can still tie two packages together."""
    graph = {
        "dynmo_hpc.pipeline.trainer": {"dynmo_hpc.launch.local"},
        "dynmo_hpc.launch.local": set(),
        "dynmo_hpc.launch.worker": {"dynmo_hpc.pipeline.stage"},
        "dynmo_hpc.pipeline.stage": {"dynmo_hpc.errors"},
        "dynmo_hpc.errors": set(),
    }
    assert _find_cycle(graph) is None
    assert _find_cycle(_package_graph(graph)) == [
        "dynmo_hpc.launch",
        "dynmo_hpc.pipeline",
        "dynmo_hpc.launch",
    ]


def test_cycle_finder_finds_a_cycle() -> None:
    """The checker itself: a planted cycle is reported, a DAG is not."""
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_only_the_cli_imports_the_cli() -> None:
    offenders = {
        name: sorted(i for i in deps if i == "dynmo_hpc.cli" or i.startswith("dynmo_hpc.cli."))
        for name, deps in _graph().items()
        if name != "dynmo_hpc.cli"
        and not name.startswith("dynmo_hpc.cli.")
        and name != "dynmo_hpc.__main__"
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"modules outside dynmo_hpc/cli import it: {offenders}"


def test_the_manager_never_loads_argparse() -> None:
    code = (
        "import sys, dynmo_hpc.slurm.manager, dynmo_hpc.slurm.submit; "
        "sys.exit('argparse' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"argparse was imported: {proc.stderr}"


def test_no_module_is_too_long() -> None:
    long = {
        name: n
        for name, path in _modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


@pytest.mark.slow
def test_wheel_carries_the_template_and_renders_sbatch(tmp_path: Path) -> None:
    """Build the wheel, install it (not editable) into a fresh directory, render a script."""
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheel_dir),
            str(ROOT),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = wheel_dir.glob("dynmo_hpc-*.whl")
    assert "dynmo_hpc/templates/dynmo_job.sbatch.j2" in zipfile.ZipFile(wheel).namelist()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run(
        [sys.executable, "-c", "import dynmo_hpc; print(dynmo_hpc.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        check=True,
        timeout=60,
    )
    assert where.stdout.strip().startswith(str(target)), where.stdout
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynmo_hpc",
            "sbatch",
            str(ROOT / "jobs" / "default.yaml"),
            "--set",
            f"job.out_dir={tmp_path / 'runs'}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("#!/bin/bash") and "#SBATCH --job-name=default" in out.stdout
    assert "-m dynmo_hpc.slurm.manager" in out.stdout
