"""Fitting a machine's per-layer rates: the fit recovers rates it was given, the held-out check
reports what it should, bad input is refused, both shipped machine files load, and the real
measure -> fit -> predict pipeline runs end to end on tiny layers (no assertion on how fast)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from dynmo_hpc.calibrate.cost_fit import (
    Sample,
    fit_rates,
    split_width,
    summarize,
    validate,
)
from dynmo_hpc.sim.cost_model import LayerShape, SchemeState, layer_cost, layer_times_s
from dynmo_hpc.sim.machine import LayerRates, load_machine

ROOT = Path(__file__).resolve().parent.parent
TRUE = LayerRates(
    flops_per_s=5e10,
    backward_flops_per_s=3e10,
    bytes_per_s=8e9,
    indexed_bytes_per_s=2e9,
    op_overhead_s=2e-5,
    overhead_s=1e-5,
    attention_flops_per_s=1.5e10,
)
STATES = [
    ("plain", SchemeState()),
    ("neurons", SchemeState(neurons_kept=0.5)),
    ("heads", SchemeState(heads_kept=0.5)),
    ("mod", SchemeState(tokens_kept=0.5)),
    ("exit", SchemeState(tokens_kept=0.5, kv_tokens_kept=1.0)),
    ("sparse", SchemeState(attention_density=0.5)),
    ("frozen", SchemeState(frozen=True)),
]


def synthetic(rates: LayerRates, widths: tuple[int, ...] = (32, 64, 128, 256)) -> list[Sample]:
    """Samples whose times are exactly what ``rates`` predict."""
    out = []
    for d in widths:
        for seq, batch in ((64, 2), (128, 4)):
            block = LayerShape(
                kind="block", d_model=d, d_ff=4 * d, num_heads=4, seq_len=seq, micro_batch=batch
            )
            cases = [(f"{d}/{seq}/{name}", block, state) for name, state in STATES]
            cases += [
                (f"{d}/{seq}/{kind}", replace(block, kind=kind, d_ff=0), SchemeState())
                for kind in ("embedding", "head")
            ]
            for label, shape, state in cases:
                forward_s, backward_s = layer_times_s(layer_cost(shape, state), rates)
                out.append(
                    Sample(
                        label=label,
                        shape=shape,
                        state=state,
                        forward_s=forward_s,
                        backward_s=backward_s,
                    )
                )
    return out


def test_the_fit_recovers_the_rates_it_was_given() -> None:
    rates = fit_rates(synthetic(TRUE))
    for name in (
        "flops_per_s",
        "backward_flops_per_s",
        "bytes_per_s",
        "indexed_bytes_per_s",
        "op_overhead_s",
        "overhead_s",
        "attention_flops_per_s",
    ):
        assert getattr(rates, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name


def test_a_held_out_width_is_predicted_exactly_from_exact_data() -> None:
    fit_on, held = split_width(synthetic(TRUE), 128)
    assert {s.shape.d_model for s in fit_on} == {32, 64, 256}
    assert {s.shape.d_model for s in held} == {128}
    summary = summarize(validate(held, fit_rates(fit_on)))
    assert summary.num_layers == len(held) == 18
    assert summary.max_any < 1e-6


def test_the_check_sees_a_wrong_rate() -> None:
    slow = replace(TRUE, flops_per_s=TRUE.flops_per_s / 2)
    errors = validate(synthetic(TRUE, widths=(256,)), slow)
    plain = next(e for e in errors if e.label == "256/128/plain")
    assert plain.forward_error > 0.2  # half the FLOP rate: a matmul-bound forward takes longer
    assert plain.backward_error == pytest.approx(0.0, abs=1e-12)  # its own rate is unchanged
    assert summarize(errors).max_forward == max(abs(e.forward_error) for e in errors)


KINDS = replace(
    TRUE,
    matmul_op_overhead_s=4e-5,
    index_op_overhead_s=3e-5,
    lookup_op_overhead_s=6e-5,
    weight_bytes_per_s=4e9,
)
"""Rates with every optional term set: each op kind its own overhead, weights their own bytes
rate."""


def test_op_kind_overheads_and_weight_rate_are_recovered() -> None:
    """Samples made with known per-kind op overheads and weight-bytes rate are fitted back to
    them; the model without those terms (every op at one overhead, no weight bytes) misses the
    same samples by far more."""
    samples = synthetic(KINDS)
    rates = fit_rates(samples)
    for name in (
        "matmul_op_overhead_s",
        "index_op_overhead_s",
        "lookup_op_overhead_s",
        "weight_bytes_per_s",
        "op_overhead_s",
        "flops_per_s",
    ):
        assert getattr(rates, name) == pytest.approx(getattr(KINDS, name), rel=1e-6), name
    assert summarize(validate(samples, rates)).max_any < 1e-9
    plain = replace(
        rates,
        matmul_op_overhead_s=None,
        index_op_overhead_s=None,
        lookup_op_overhead_s=None,
        weight_bytes_per_s=None,
    )
    assert summarize(validate(samples, plain)).max_any > 0.2


def committed_samples(name: str) -> list[Sample]:
    """The samples of ``benchmarks/<name>`` (written by benchmarks/fit_cost_model.py)."""
    data = json.loads((ROOT / "benchmarks" / name).read_text())
    return [
        Sample(
            label=item["label"],
            shape=LayerShape(**item["shape"]),
            state=SchemeState(**item["state"]),
            forward_s=item["forward_s"],
            backward_s=item["backward_s"],
        )
        for item in data["samples"]
    ]


@pytest.mark.parametrize(
    ("name", "within", "max_error"),
    [
        ("cost_samples_2core_idle.json", 36, 0.15),
        ("cost_samples_2core.json", 34, 0.24),
        ("cost_samples_2core_fresh.json", 35, 0.18),
    ],
)
def test_the_committed_samples_hold_out_width_192(name: str, within: int, max_error: float) -> None:
    """What docs/simulate.md reports: fitted on widths 32, 64, 128 and 256 of each committed
    sample file, ``within`` of the 36 layers of width 192 are within 15 % (forward, backward and
    their sum; every one on the idle machine's samples), the worst under ``max_error`` and the
    median sum under 5 %."""
    samples = committed_samples(name)
    fit_on, held = split_width(samples, 192)
    errors = validate(held, fit_rates(fit_on))
    worst = [max(abs(e.forward_error), abs(e.backward_error), abs(e.total_error)) for e in errors]
    assert sum(w <= 0.15 for w in worst) >= within
    summary = summarize(errors)
    assert summary.max_any < max_error
    assert summary.median_total < 0.05


def test_noise_moves_the_fit_a_little() -> None:
    samples = synthetic(TRUE)
    noisy = [
        replace(s, forward_s=s.forward_s * (1.05 if i % 2 else 0.95), backward_s=s.backward_s)
        for i, s in enumerate(samples)
    ]
    rates = fit_rates(noisy)
    assert rates.flops_per_s == pytest.approx(TRUE.flops_per_s, rel=0.2)
    assert summarize(validate(noisy, rates)).median_forward < 0.1


def test_columns_without_data_leave_their_rate_unset() -> None:
    plain = [s for s in synthetic(TRUE) if s.label.endswith(("plain", "neurons", "head"))]
    rates = fit_rates(plain)
    assert rates.indexed_bytes_per_s is None  # nothing measured gathers
    assert rates.flops_per_s == pytest.approx(TRUE.flops_per_s, rel=1e-6)


def test_bad_samples_are_refused() -> None:
    sample = synthetic(TRUE, widths=(32,))[0]
    with pytest.raises(ValueError, match="no samples to fit; HINT"):
        fit_rates([])
    with pytest.raises(ValueError, match=r"sample 32/64/plain: forward_s=0.0 must be > 0"):
        fit_rates([replace(sample, forward_s=0.0)])
    with pytest.raises(ValueError, match=r"held-out width 48 .* HINT: hold out one of .*\[32\]"):
        split_width([sample], 48)
    embeddings = [s for s in synthetic(TRUE) if s.shape.kind == "embedding"]
    with pytest.raises(ValueError, match="cannot fix this rate; HINT"):
        fit_rates(embeddings)  # no matmul anywhere: no FLOP rate
    with pytest.raises(ValueError, match="no layers to summarise"):
        summarize([])


@pytest.mark.parametrize(
    "path", ["dynmo_hpc/sim/machines/cpu_2core.json", "benchmarks/machine_h200.json"]
)
def test_the_shipped_machine_files_carry_layer_rates(path: str) -> None:
    model = load_machine(ROOT / path)
    assert model.layer_rates is not None
    assert model.notes is not None
    forward_s, backward_s = layer_times_s(
        layer_cost(
            LayerShape(
                kind="block", d_model=1024, d_ff=4096, num_heads=16, seq_len=1024, micro_batch=1
            )
        ),
        model.layer_rates,
    )
    assert 0 < forward_s < backward_s


def test_every_constant_of_the_gpu_file_is_cited() -> None:
    data = json.loads((ROOT / "benchmarks" / "machine_h200.json").read_text())
    constants = {key for key in data if key != "notes"}
    sources = data["notes"]["constants"]
    assert constants == set(sources), "every constant needs its entry in notes.constants"
    for key in constants:
        entry = sources[key]
        assert entry["assumption"] and entry["source"], key
        assert math.isclose(float(entry["value"]), data[key], rel_tol=1e-9), key


def test_measure_fit_predict_end_to_end_on_small_layers() -> None:
    torch = pytest.importorskip("torch")  # the CPU wheel is a project dependency
    from dynmo_hpc.calibrate.cost_measure import build_case, measure, standard_cases

    cases = [c for d in (32, 64, 128) for c in standard_cases(d, 64, 2)]
    assert {c.label.rpartition("/")[2] for c in cases} >= {"plain", "mod0.5", "sparse0.5"}
    threads = torch.get_num_threads()
    try:
        samples = measure(cases, repeats=3, warmup=1)
    finally:
        torch.set_num_threads(threads)
    assert [s.label for s in samples] == [c.label for c in cases]
    assert all(s.forward_s > 0 and s.backward_s > 0 for s in samples)
    # Predicted with rates the committed idle samples fix (eleven unknowns need all five widths
    # and three shapes: a fit on 24 layers measured here in seconds, on a loaded machine, may
    # leave a rate unfixed, which fit_rates refuses by design). The fit itself is checked on
    # the committed files above.
    _, held = split_width(samples, 64)
    errors = validate(held, fit_rates(committed_samples("cost_samples_2core_idle.json")))
    assert len(errors) == len(held) == 12
    assert all(math.isfinite(e.total_error) for e in errors)
    # The layers built are the states named: half the neurons, a quarter of the tokens kept.
    pruned = build_case(next(c for c in cases if c.label == "d64/t64/b2/neurons0.5"))
    assert pruned.mlp.c_fc.out_features == 128
    mod = next(c for c in cases if c.label == "d64/t64/b2/mod0.25")
    assert mod.state.tokens_kept == 16 / 64


def test_fresh_samples_every_layer_total_within_15_percent_at_width_192() -> None:
    """The check made after the model's terms were chosen: samples measured afterwards on the
    idle machine (benchmarks/cost_samples_2core_fresh.json), fitted without width 192; each
    layer's forward plus backward at width 192 is within 15 % (the one pass outside it is the
    embedding's 0.16 ms forward at 64 tokens x 2)."""
    samples = committed_samples("cost_samples_2core_fresh.json")
    fit_on, held = split_width(samples, 192)
    errors = validate(held, fit_rates(fit_on))
    assert len(errors) == 36
    assert max(abs(e.total_error) for e in errors) < 0.15
