"""Property: any job file and ``--set`` overrides load into a JobConfig or a one-line ConfigError.

Hypothesis writes 1,000 job files (plausible values near the defaults, and hostile ones: wrong
types, NaN, huge and negative numbers, control characters, nested junk, unknown keys,
sexagesimal-looking strings, raw text) and passes overrides through the public loader,
:func:`dynmo_hpc.config.load`. Any other exception fails the test, as does a ConfigError that is
not one line with a HINT. Three of the valid configs (the first three, in Hypothesis's
deterministic order, that still validate on a tiny model) then train for 2 steps.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynmo_hpc import config as config_mod
from dynmo_hpc.config import ConfigError, JobConfig
from dynmo_hpc.launch.local import launch_local
from tests.helpers.jobs import read_result

NUM_EXAMPLES = 1000
NUM_TRAINED = 3

HUGE_INTS = st.one_of(
    st.integers(min_value=2**31 - 1, max_value=2**70),
    st.integers(min_value=-(2**70), max_value=-1),
    st.sampled_from([2**31, 2**32, 2**63, 2**64, 10**30]),
)
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -0.0, 1e-300, 1e308]),
)
HOSTILE_TEXT = st.one_of(
    st.text(max_size=12),
    st.from_regex(r"\A[0-9]{1,3}(:[0-9]{1,2}){1,2}\Z"),  # YAML 1.1 would read these as base 60
    st.from_regex(r"\A[0-9]{1,2}-[0-9]{1,2}(:[0-9]{2}){0,2}\Z"),  # SLURM's D-HH[:MM[:SS]]
    st.sampled_from(
        ["1e30", "nan", "-inf", "true", "yes", "", " ", "a\nb", "x\0y", "$(id)", "a" * 5000]
    ),
)
JUNK = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), FLOATS, HOSTILE_TEXT),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
"""Values of any type, for any key."""


def _fields(cls: type) -> dict[str, Any]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _plausible(hint: Any, default: Any) -> st.SearchStrategy[Any]:
    """Values an engineer might write for a field of this type: near the default."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return st.sampled_from(args)
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, int):
        return st.sampled_from(sorted({default, default + 1, 2 * default or 1}))
    if isinstance(default, float):
        return st.sampled_from(sorted({default, default / 2, min(default * 2, 0.9), 0.0, 0.5}))
    if default is None and int in args:
        return st.one_of(st.none(), st.integers(min_value=0, max_value=8))
    if default is None and float in args:
        return st.one_of(st.none(), st.sampled_from([0.5, 1e9, 1e12]))
    return st.just(default)


def _hostile(hint: Any) -> st.SearchStrategy[Any]:
    """Values of the right type but out of range, or of the wrong type."""
    text = str(hint)
    if "int" in text:
        return st.one_of(HUGE_INTS, st.integers(min_value=-5, max_value=0), FLOATS, JUNK)
    if "float" in text:
        return st.one_of(FLOATS, HUGE_INTS, HOSTILE_TEXT, JUNK)
    return st.one_of(HOSTILE_TEXT, JUNK)


def _value(hint: Any, default: Any) -> st.SearchStrategy[Any]:
    """Mostly plausible (so that many whole configs are valid), sometimes hostile."""
    plausible = _plausible(hint, default)
    return st.one_of(*[plausible] * 7, _hostile(hint))


def _field_strategies(cls: type) -> dict[str, st.SearchStrategy[Any]]:
    """One value strategy per field of ``cls``, built once (building them per draw is slow)."""
    fields = _fields(cls)
    out: dict[str, st.SearchStrategy[Any]] = {}
    for name, hint in typing.get_type_hints(cls).items():
        if name not in fields:  # a ClassVar (e.g. RENAMED_KEYS), not a YAML key
            continue
        inner = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        if inner:  # a scheme: empty (its defaults), a few of its keys, or junk
            out[name] = st.one_of(st.just({}), _section(inner[0], 2), _section(inner[0], 2), JUNK)
        else:
            out[name] = _value(hint, _default(fields[name]))
    return out


ONE_IN_TEN = st.sampled_from([False] * 9 + [True])
"""Uniform over its list (``st.integers`` would favour the boundaries)."""
UNKNOWN_KEY = st.tuples(st.text(min_size=1, max_size=8), JUNK)


def _section(cls: type, max_keys: int) -> st.SearchStrategy[dict[str, Any]]:
    """A few keys of ``cls`` (and sometimes an unknown one) with plausible or hostile values."""
    values = _field_strategies(cls)

    @st.composite
    def draw_section(draw: st.DrawFn) -> dict[str, Any]:
        names = draw(st.lists(st.sampled_from(sorted(values)), max_size=max_keys, unique=True))
        section = {name: draw(values[name]) for name in names}
        if draw(ONE_IN_TEN):
            key, junk = draw(UNKNOWN_KEY)
            section[key] = junk
        return section

    return draw_section()


SECTIONS = {name: _section(cls, 3) for name, cls in typing.get_type_hints(JobConfig).items()}
OVERRIDE_VALUES = {
    (section, key): st.one_of(
        *[value.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip())] * 3,
        HOSTILE_TEXT,
    )
    for section, cls in typing.get_type_hints(JobConfig).items()
    for key, value in _field_strategies(cls).items()
}
"""``--set section.key=VALUE`` texts: a value written as YAML, or raw hostile text."""


SHAPES = st.sampled_from(["dump"] * 18 + ["raw", "scalar"])
"""How the job file is written: YAML of generated data, raw text, or one unquoted scalar."""


@st.composite
def job_texts(draw: st.DrawFn) -> tuple[str, list[str]]:
    """(YAML text of a job file, ``--set`` overrides)."""
    chosen = draw(st.lists(st.sampled_from(sorted(SECTIONS)), max_size=3, unique=True))
    data: dict[Any, Any] = {name: draw(SECTIONS[name]) for name in chosen}
    if draw(ONE_IN_TEN):
        data[draw(st.text(max_size=6))] = draw(JUNK)  # an unknown (or junk) section
    text = yaml.safe_dump(data, allow_unicode=True)
    shape = draw(SHAPES)
    if shape == "raw":
        text = draw(st.text(max_size=40))  # raw text: maybe YAML, maybe not
    elif shape == "scalar":
        key = draw(st.sampled_from(["slurm:\n  time_min", "train:\n  steps", "job:\n  seed"]))
        text = f"{key}: {draw(HOSTILE_TEXT).replace(chr(10), ' ')}\n"  # unquoted scalars
    keys = draw(st.lists(st.sampled_from(sorted(OVERRIDE_VALUES)), max_size=2))
    overrides = [f"{s}.{k}={draw(OVERRIDE_VALUES[s, k]).removesuffix('...')}" for s, k in keys]
    return text, overrides


def _load_fuzzed(directory: Path) -> tuple[list[JobConfig], int]:
    """Run the property; returns the valid configs (in generation order) and the refusals."""
    valid: list[JobConfig] = []
    refused = [0]
    path = directory / "job.yaml"

    @settings(
        max_examples=NUM_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=job_texts())
    def check(case: tuple[str, list[str]]) -> None:
        text, overrides = case
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            cfg = config_mod.load(path, overrides)
        except ConfigError as exc:
            message = str(exc)
            assert "\n" not in message, f"multi-line error: {message!r}"
            assert "HINT:" in message, f"no HINT: {message!r}"
            refused[0] += 1
            return
        assert isinstance(cfg, JobConfig)
        valid.append(cfg)

    check()
    return valid, refused[0]


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[JobConfig], int]:
    return _load_fuzzed(tmp_path_factory.mktemp("fuzz"))


def test_fuzzed_jobs_load_or_are_refused_with_one_line(
    fuzzed: tuple[list[JobConfig], int],
) -> None:
    valid, refused = fuzzed
    assert len(valid) + refused >= 1000
    # Both outcomes are exercised in bulk (a generator that only made junk would prove little).
    assert len(valid) >= 100 and refused >= 300, (len(valid), refused)
    for cfg in valid[:50]:  # a loaded config is really valid: it round-trips through its YAML
        assert config_mod.from_dict(yaml.safe_load(cfg.to_yaml()), source="<fuzz>") == cfg


TINY: dict[str, dict[str, Any]] = {
    "job": {"name": "fuzz", "seed": 0},
    "model": {"num_blocks": 2, "d_model": 32, "num_heads": 2, "d_ff": 64, "seq_len": 16},
    "data": {"path": None, "val_fraction": 0.1},
    "train": {"steps": 2, "micro_batch_size": 2, "num_microbatches": 2, "log_interval": 1},
    "pipeline": {"num_stages": 1, "schedule": "1f1b", "partition": None},
    "runtime": {"device": "cpu", "threads_per_rank": 1, "timeout_s": 120.0},
    "checkpoint": {"every_steps": 0, "every_minutes": 0.0, "at_end": False},
    "elastic": {"enabled": False},
}
"""What a sampled config trains with: the fuzzed balance and scheme settings, on a tiny model."""


def _tiny(cfg: JobConfig, out_dir: Path) -> JobConfig | None:
    """``cfg`` shrunk to 2 quick steps; None when its schemes do not fit the tiny model."""
    data = cfg.to_dict()
    for section, values in TINY.items():
        data[section] = {**data[section], **values}
    data["model"]["layer_d_ff"] = None
    data["job"]["out_dir"] = str(out_dir)
    moe = data["schemes"]["moe"]
    if moe is not None and (moe["num_experts"] > 4 or (moe["d_ff_expert"] or 0) > 256):
        return None  # valid, but too big to train in seconds
    try:
        return config_mod.from_dict(data, source="<tiny fuzz>")
    except ConfigError:
        return None


def test_a_sample_of_valid_fuzzed_jobs_trains(
    fuzzed: tuple[list[JobConfig], int], tmp_path: Path
) -> None:
    valid, _ = fuzzed
    sample = []
    for index, cfg in enumerate(valid):
        tiny = _tiny(cfg, tmp_path / f"run{index}")
        if tiny is not None and tiny not in sample:
            sample.append(tiny)
        if len(sample) == NUM_TRAINED:
            break
    assert len(sample) == NUM_TRAINED
    for cfg in sample:
        rc, run_dir = launch_local(cfg, timeout_s=120.0)
        assert rc == 0, f"{cfg.to_yaml()}\nfailed with exit code {rc}"
        result = read_result(run_dir)
        assert len(result["losses"]) == 2 and all(math.isfinite(x) for x in result["losses"])
