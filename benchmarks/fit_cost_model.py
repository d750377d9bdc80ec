"""Fit this machine's per-layer rates on measured layers and check them at a width left out.

What it does, in order:
  1. measures the project's real layers (embedding, head, blocks plain, pruned, MoD, early
     exit, block-sparse, frozen) at each --widths d_model (d_ff = 4 d_model) and each
     --shapes sequence x micro batch, in this process on one torch thread: the median thread
     CPU seconds of the forward and of the backward over --repeats interleaved rounds
     (dynmo_hpc/calibrate/cost_measure.py); or reads them back with --from-samples;
  2. fits the rates (dynmo_hpc/calibrate/cost_fit.py) on every width but --hold-out;
  3. prints, per layer of the held-out width, predicted against measured (forward, backward,
     their sum) and the max and median relative error, then the same summary with each width
     held out in turn;
  4. --write-machine FILE puts the rates of step 2's fit (the ones the table checks) into a
     machine file, keeping what else it holds: dynmo_hpc/sim/machines/cpu_2core.json, the
     calibration `dynmo-hpc simulate` ships for this machine (benchmarks/heldout_sim.py
     --write-machine keeps these rates when it rewrites that file), from the idle-machine
     samples benchmarks/cost_samples_2core_idle.json.

    PYTHONPATH=. .venv/bin/python benchmarks/fit_cost_model.py \\
        [--widths 32,64,128,192,256] [--shapes 64x2,128x2,128x4] [--hold-out 192] \\
        [--repeats 15] [--samples-out FILE | --from-samples FILE] [--write-machine FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dynmo_hpc.atomic_io import atomic_write_text  # noqa: E402
from dynmo_hpc.calibrate.cost_fit import (  # noqa: E402
    ErrorSummary,
    LayerError,
    Sample,
    fit_rates,
    split_width,
    summarize,
    validate,
)
from dynmo_hpc.sim.cost_model import LayerShape, SchemeState  # noqa: E402
from dynmo_hpc.sim.machine import LayerRates, MachineModel, load_machine, save_machine  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        seq, _, batch = item.partition("x")
        out.append((int(seq), int(batch)))
    return out


def measure_samples(args: argparse.Namespace) -> list[Sample]:
    from dynmo_hpc.calibrate.cost_measure import (  # torch: only when measuring
        measure,
        standard_cases,
    )

    cases = [
        case
        for width in _ints(args.widths)
        for seq, batch in _shapes(args.shapes)
        for case in standard_cases(width, seq, batch)
    ]
    start = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {message}", file=sys.stderr, flush=True)

    print(f"measuring {len(cases)} layers, load average {os.getloadavg()}", file=sys.stderr)
    samples = measure(cases, repeats=args.repeats, progress=progress)
    print(f"done, load average {os.getloadavg()}", file=sys.stderr)
    return samples


def samples_to_json(samples: list[Sample]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(s) for s in samples]


def samples_text(measured_with: dict[str, Any], samples: list[Sample]) -> str:
    """The samples file: one sample a line, so that a diff shows which layers changed."""
    lines = ",\n".join("  " + json.dumps(s, sort_keys=True) for s in samples_to_json(samples))
    head = json.dumps(measured_with, sort_keys=True)
    return f'{{\n "measured_with": {head},\n "samples": [\n{lines}\n ]\n}}\n'


def samples_from_json(data: list[dict[str, Any]]) -> list[Sample]:
    out = []
    for item in data:
        state = dict(item["state"])
        if state.get("expert_loads") is not None:
            state["expert_loads"] = tuple(state["expert_loads"])
        out.append(
            Sample(
                label=item["label"],
                shape=LayerShape(**item["shape"]),
                state=SchemeState(**state),
                forward_s=item["forward_s"],
                backward_s=item["backward_s"],
            )
        )
    return out


def print_table(errors: list[LayerError]) -> None:
    print(
        f"{'layer':30} {'fwd ms meas/pred':>18} {'err':>6} {'bwd ms meas/pred':>18} "
        f"{'err':>6} {'sum err':>7}"
    )
    for e in errors:
        print(
            f"{e.label:30} {e.measured_forward_s * 1e3:8.3f}/{e.predicted_forward_s * 1e3:<8.3f}"
            f" {e.forward_error:+6.1%} {e.measured_backward_s * 1e3:8.3f}/"
            f"{e.predicted_backward_s * 1e3:<8.3f} {e.backward_error:+6.1%} {e.total_error:+7.1%}"
        )


def summary_line(name: str, s: ErrorSummary) -> str:
    return (
        f"{name}: {s.num_layers} layers; max |err| fwd {s.max_forward:.1%}, bwd "
        f"{s.max_backward:.1%}, sum {s.max_total:.1%}; median fwd {s.median_forward:.1%}, "
        f"bwd {s.median_backward:.1%}, sum {s.median_total:.1%}"
    )


def within_15(errors: list[LayerError]) -> int:
    """Layers whose forward, backward and sum are all within 15 % of measured."""
    return sum(
        max(abs(e.forward_error), abs(e.backward_error), abs(e.total_error)) <= 0.15 for e in errors
    )


def write_machine(path: Path, rates: LayerRates, notes: dict[str, Any]) -> None:
    """Merge the layer rates and their provenance into ``path`` (created if missing)."""
    model = load_machine(path) if path.exists() else MachineModel()
    merged = {**(model.notes or {}), "layer_rates": notes}
    save_machine(dataclasses.replace(model, layer_rates=rates, notes=merged), path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="32,64,128,192,256")
    p.add_argument("--shapes", default="64x2,128x2,128x4", help="seq_len x micro batch, ...")
    p.add_argument("--hold-out", type=int, default=192, help="the width the fit never sees")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--samples-out", type=Path)
    p.add_argument("--from-samples", type=Path)
    p.add_argument("--write-machine", type=Path)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    if args.from_samples:
        try:
            saved = json.loads(args.from_samples.read_text())
            samples = samples_from_json(saved["samples"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(
                f"error: cannot read samples from {args.from_samples}: {exc!r}; HINT: give a "
                "file this script wrote with --samples-out",
                file=sys.stderr,
            )
            return 2
        measured_with = saved.get("measured_with", {})
    else:
        load_before = [round(v, 2) for v in os.getloadavg()]
        samples = measure_samples(args)
        measured_with = {
            "command": " ".join(["benchmarks/fit_cost_model.py", *(argv or sys.argv[1:])]),
            "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average_1_5_15_before": load_before,
            "load_average_1_5_15_after": [round(v, 2) for v in os.getloadavg()],
        }
    if args.samples_out:
        atomic_write_text(args.samples_out, samples_text(measured_with, samples))
    try:
        fit_on, held = split_width(samples, args.hold_out)
        rates = fit_rates(fit_on)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"rates fitted on widths other than {args.hold_out}: {rates}")
    held_errors = validate(held, rates)
    print_table(held_errors)
    main_summary = summarize(held_errors)
    print(summary_line(f"held-out width {args.hold_out}", main_summary))
    within = within_15(held_errors)
    print(f"{within} of {len(held_errors)} layers within 15 % (forward, backward and sum)")
    loo = {}
    for width in sorted({s.shape.d_model for s in samples}):
        rest, out = split_width(samples, width)
        errors = validate(out, fit_rates(rest))
        loo[width] = summarize(errors)
        line = summary_line(f"  width {width} held out", loo[width])
        print(f"{line}; {within_15(errors)} within 15 %")
    if args.write_machine:
        notes = {
            **measured_with,
            "fitted_on_widths": sorted({s.shape.d_model for s in fit_on}),
            "held_out_width": args.hold_out,
            "held_out_max_abs_error": round(main_summary.max_any, 4),
            "held_out_median_abs_error_sum": round(main_summary.median_total, 4),
            "held_out_layers_within_15_percent": f"{within} of {len(held_errors)}",
            "how": "benchmarks/fit_cost_model.py; docs/simulate.md#per-layer-cost-model",
        }
        if args.from_samples:
            notes["samples"] = str(args.from_samples)
        write_machine(args.write_machine, rates, notes)
        print(f"wrote the layer rates into {args.write_machine}")
    if args.json_out:
        out = {
            "rates": dataclasses.asdict(rates),
            "held_out": [dataclasses.asdict(e) for e in held_errors],
            "summary": dataclasses.asdict(main_summary),
            "leave_one_width_out": {str(w): dataclasses.asdict(s) for w, s in loo.items()},
        }
        atomic_write_text(args.json_out, json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
