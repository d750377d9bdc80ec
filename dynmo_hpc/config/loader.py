"""Strict loading: YAML and ``--set`` overrides into a validated :class:`JobConfig`.

Why strict: a typo in a batch job (``num_microbatch: 8``) that is silently ignored costs a queue
wait plus a wasted allocation. Every unknown key and wrong type is rejected before any rank
starts, with an error naming the key, the file and the valid keys.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

from dynmo_hpc.config.data_source import TOKEN_FILE_SUFFIX, data_vocab_size, resolve_vocab_size
from dynmo_hpc.config.hf_model import apply_init_from
from dynmo_hpc.config.job import JobConfig
from dynmo_hpc.config.strict_yaml import parse_yaml
from dynmo_hpc.errors import ConfigError

log = logging.getLogger(__name__)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


MAX_INT_BITS = 63
"""No job setting needs an integer beyond 64 bits; larger ones are typos (or hostile) and would
overflow numpy and torch on the ranks."""

GENERIC_HINT = "HINT: fix it in the job file, or override it with --set SECTION.KEY=VALUE"
"""Appended to a config error whose message has no more specific HINT."""


def with_hint(message: str) -> str:
    """``message`` ending with a HINT (the CLI's contract for every error line)."""
    return message if "HINT:" in message else f"{message}; {GENERIC_HINT}"


def show(value: Any, limit: int = 60) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters (never raises)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<an integer of {value.bit_length()} bits>"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check ``value`` against the annotation ``tp``; returns the (possibly converted) value."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, source)
            except ConfigError as exc:
                errors.append(str(exc))
        if len(errors) == 1:  # ``X | None``: X's own message names the bad key inside it
            raise ConfigError(errors[0])
        raise ConfigError(
            f"{source}: {key}={show(value)} has the wrong type; expected {_type_name(tp)}"
        )
    if origin is Literal:
        if value not in args:
            raise ConfigError(
                f"{source}: {key}={show(value)} is not valid; choose one of {list(args)}"
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(
                f"{source}: {key}={show(value)} must be a list of {_type_name(args[0])}"
            )
        return [_coerce(v, args[0], f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}={show(value)} must be a mapping")
        return {str(k): _coerce(v, args[1], f"{key}.{k}", source) for k, v in value.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} must be a mapping of {tp.__name__} keys")
        return _build(tp, value, f"{key}.", source)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(
                f"{source}: {key}={show(value)} must be true or false; HINT: write true or "
                "false, unquoted"
            )
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads "1e-3" (no dot) as a string; accept any Python float literal.
            try:
                number = float(value)
            except ValueError:
                raise ConfigError(f"{source}: {key}={show(value)} must be a number") from None
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{source}: {key}={show(value)} must be a number")
        else:
            try:
                number = float(value)
            except OverflowError:
                number = math.inf
        if not math.isfinite(number):
            raise ConfigError(
                f"{source}: {key}={show(value)} must be a finite number (NaN and infinities would "
                "only fail later, on the ranks)"
            )
        return number
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(
                f"{source}: {key}={show(value)} must be an integer; HINT: write a whole number "
                "without a decimal point or exponent, e.g. 8"
            )
        if value.bit_length() > MAX_INT_BITS:
            raise ConfigError(
                f"{source}: {key}={show(value)} does not fit in 64 bits; HINT: a typo? no job "
                "setting is that large"
            )
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(
                f'{source}: {key}={show(value)} must be a string; HINT: quote it, e.g. "yes"'
            )
        return value
    raise ConfigError(f"{source}: {key}: unsupported field type {_type_name(tp)}")


def _build(cls: type, data: dict[str, Any], prefix: str, source: str) -> Any:
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        renamed: dict[str, str] = getattr(cls, "RENAMED_KEYS", {})
        if key not in valid and key in renamed:
            raise ConfigError(
                f"{source}: {show(prefix + str(key))} was replaced by {renamed[key]}; "
                "HINT: rename the key in the YAML or --set"
            )
        if key not in valid:
            raise ConfigError(
                f"{source}: unknown key {show(prefix + str(key))}; valid keys under "
                f"'{prefix.rstrip('.') or '<top>'}' are: {', '.join(valid)}"
            )
        kwargs[key] = _coerce(value, hints[key], prefix + key, source)
    return cls(**kwargs)


def from_dict(data: dict[str, Any], source: str = "<dict>") -> JobConfig:
    """Build and validate a :class:`JobConfig`; errors are prefixed with ``source``."""
    try:
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of sections")
        model = data.get("model")
        if isinstance(model, dict) and model.get("init_from") is not None:
            data = {**data, "model": apply_init_from(model)}
        cfg: JobConfig = _build(JobConfig, data, "", source)
        try:
            cfg = _tokens_take_no_tokenizer(cfg)
            cfg = _with_data_vocab(cfg, explicit="vocab_size" in (data.get("model") or {}))
            cfg.validate()
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    except ConfigError as exc:
        raise ConfigError(with_hint(str(exc))) from None
    return cfg


def _tokens_take_no_tokenizer(cfg: JobConfig) -> JobConfig:
    """``cfg`` with ``data.tokenizer`` dropped when ``data.path`` is already tokens (a prepared
    directory or a ``.bin`` file), with one warning line.

    Why: ``data.tokenizer`` says how to tokenize *text*; a job that tokenizes its text on first
    use must still switch to a prepared dataset with ``--set data.path=DIR`` alone.
    """
    data = cfg.data
    if data.tokenizer is None or data.path is None:
        return cfg
    if not (Path(data.path).is_dir() or data.path.endswith(TOKEN_FILE_SUFFIX)):
        return cfg
    log.warning(
        "data.path=%r is already tokens: data.tokenizer is not used (the data's own vocabulary "
        "applies)",
        data.path,
    )
    return dataclasses.replace(cfg, data=dataclasses.replace(data, tokenizer=None))


def _with_data_vocab(cfg: JobConfig, *, explicit: bool) -> JobConfig:
    """``cfg`` with ``model.vocab_size`` the data's when the job left it out (refused when set
    smaller than the data's, :func:`~dynmo_hpc.config.data_source.resolve_vocab_size`)."""
    cfg.data.validate()  # the data's vocabulary is read from the files it names
    data_vocab = data_vocab_size(cfg.data.path, cfg.data.tokenizer)
    vocab = resolve_vocab_size(cfg.model.vocab_size, explicit, data_vocab)
    if vocab == cfg.model.vocab_size:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))


def parse_override(text: str) -> tuple[list[str], Any]:
    """``section.key=value`` -> (["section", "key"], value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"--set {show(text)}: expected section.key=value, e.g. train.steps=20")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if len(path) < 2:
        raise ConfigError(f"--set {show(text)}: expected section.key=value, e.g. train.steps=20")
    value = parse_yaml(raw, f"--set {show(text)}") if raw.strip() else None
    return path, value


def set_dotted(data: dict[str, Any], key: str, value: Any, what: str = "--set") -> None:
    """Set ``data["a"]["b"] = value`` for ``key="a.b"``, creating sections; ``what`` names the
    option in errors (``--set``, ``--sweep``)."""
    path = [p for p in key.split(".") if p]
    node = data
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{what} {key!r}: {part!r} is not a section")
        node = child
    node[path[-1]] = value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--set`` overrides to raw config data (validated later with the file)."""
    out: dict[str, Any] = _deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        set_dotted(out, ".".join(path), value)
    return out


def _deepcopy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deepcopy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deepcopy(v) for v in data]
    return data


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a job YAML into plain data, with errors that name the file."""
    p = Path(path)
    try:
        is_dir, is_file = p.is_dir(), p.is_file()
    except OSError as exc:  # a name too long for the file system, a permission error
        raise ConfigError(
            f"{p}: cannot check the job file ({exc.strerror}); HINT: pass a YAML file such as "
            "jobs/default.yaml"
        ) from None
    if is_dir:
        raise ConfigError(f"{p} is a directory; HINT: pass a YAML file such as jobs/default.yaml")
    if not is_file:
        raise ConfigError(f"{p}: job file not found; pass a YAML file such as jobs/default.yaml")
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(
            f"{p}: cannot read the job file ({exc.strerror}); HINT: check its permissions"
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{p}: the job file is not UTF-8 text (byte {exc.start}); HINT: save it as UTF-8"
        ) from None
    data = parse_yaml(text, str(p))
    if data is None:
        raise ConfigError(
            f"{p}: the job file is empty; HINT: start from jobs/default.yaml (an empty file would "
            "silently train the built-in defaults)"
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"{p}: the top level must be a mapping of sections (job:, model:, ...); HINT: "
            "jobs/default.yaml lists every section and key with its type"
        )
    return data


def load(path: str | Path, overrides: list[str] | None = None) -> JobConfig:
    """Load a job YAML, apply ``section.key=value`` overrides, validate."""
    try:
        data = apply_overrides(load_yaml(path), overrides or [])
    except ConfigError as exc:
        raise ConfigError(with_hint(str(exc))) from None
    return from_dict(data, source=str(path))
