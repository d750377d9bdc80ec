"""Strict loading: YAML and ``--set`` overrides into a validated :class:`JobConfig`.

Why strict: a typo in a batch job (``num_microbatch: 8``) that is silently ignored costs a queue
wait plus a wasted allocation. Every unknown key and wrong type is rejected before any rank
starts, with an error naming the key, the file and the valid keys.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from dynmo_hpc.config.job import JobConfig
from dynmo_hpc.errors import ConfigError


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


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
            f"{source}: {key}={value!r} has the wrong type; expected {_type_name(tp)}"
        )
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{source}: {key}={value!r} is not valid; choose one of {list(args)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {key}={value!r} must be a list of {_type_name(args[0])}")
        return [_coerce(v, args[0], f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}={value!r} must be a mapping")
        return {str(k): _coerce(v, args[1], f"{key}.{k}", source) for k, v in value.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} must be a mapping of {tp.__name__} keys")
        return _build(tp, value, f"{key}.", source)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: {key}={value!r} must be true or false")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads "1e-3" (no dot) as a string; accept any Python float literal.
            try:
                number = float(value)
            except ValueError:
                raise ConfigError(f"{source}: {key}={value!r} must be a number") from None
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{source}: {key}={value!r} must be a number")
        else:
            try:
                number = float(value)
            except OverflowError:
                number = math.inf
        if not math.isfinite(number):
            raise ConfigError(
                f"{source}: {key}={value!r} must be a finite number (NaN and infinities would "
                "only fail later, on the ranks)"
            )
        return number
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: {key}={value!r} must be an integer")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{source}: {key}={value!r} must be a string")
        return value
    raise ConfigError(f"{source}: {key}: unsupported field type {_type_name(tp)}")


def _build(cls: type, data: dict[str, Any], prefix: str, source: str) -> Any:
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        if key not in valid:
            raise ConfigError(
                f"{source}: unknown key '{prefix}{key}'; valid keys under "
                f"'{prefix.rstrip('.') or '<top>'}' are: {', '.join(valid)}"
            )
        kwargs[key] = _coerce(value, hints[key], prefix + key, source)
    return cls(**kwargs)


def from_dict(data: dict[str, Any], source: str = "<dict>") -> JobConfig:
    """Build and validate a :class:`JobConfig`; errors are prefixed with ``source``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections; {KEYS_HINT}")
    try:
        cfg: JobConfig = _build(JobConfig, data, "", source)
    except ConfigError as exc:
        raise ConfigError(_with_hint(str(exc))) from None
    try:
        cfg.validate()
    except ConfigError as exc:
        raise ConfigError(_with_hint(f"{source}: {exc}")) from None
    return cfg


KEYS_HINT = "HINT: jobs/default.yaml lists every section and key with its type"


def _with_hint(message: str) -> str:
    """One line ending with a HINT: every ``error:`` the CLI prints says how to fix it."""
    line = " ".join(message.split())
    return line if "HINT:" in line else f"{line}; {KEYS_HINT}"


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error in one line: what and where (PyYAML's own text spans several lines)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        what = exc.problem or exc.context or "syntax error"
        return f"{what} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(exc).split())


def parse_override(text: str) -> tuple[list[str], Any]:
    """``section.key=value`` -> (["section", "key"], value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. train.steps=20")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if len(path) < 2:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. train.steps=20")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value is not valid YAML: {exc}") from None
    return path, value


def set_dotted(data: dict[str, Any], key: str, value: Any, what: str = "--set") -> None:
    """Set ``data["a"]["b"] = value`` for ``key="a.b"``, creating sections; ``what`` names the
    option in errors (``--set``, ``--sweep``)."""
    path = [p for p in key.split(".") if p]
    node = data
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{what} {key!r}: '{part}' is not a section")
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


class StrictLoader(yaml.SafeLoader):  # type: ignore[misc]  # yaml ships no stubs here
    """``yaml.SafeLoader`` that refuses duplicate keys (YAML keeps the last one silently) and
    aliases (``*name``: a few hundred bytes of nested aliases expand to gigabytes)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.YAMLError(
                f"aliases (*{event.anchor}) are not allowed in job files {event.start_mark}; "
                "HINT: write the values out"
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.YAMLError(
                    f"duplicate key {key!r} {key_node.start_mark}; HINT: keep one of them"
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a job YAML into plain data, with errors that name the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: job file not found; pass a YAML file such as jobs/default.yaml")
    try:
        text = p.read_bytes().decode()
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{p}: not a text file (byte {exc.start} is not UTF-8); HINT: a job file is YAML "
            "text, start from jobs/default.yaml"
        ) from None
    try:
        data = yaml.load(text, Loader=StrictLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(
            _with_hint(f"{p}: not valid YAML: {_yaml_problem(exc)}").replace(
                KEYS_HINT, "HINT: fix the YAML there (jobs/default.yaml shows the layout)"
            )
        ) from None
    if data is None:
        raise ConfigError(
            f"{p}: the job file is empty; HINT: start from jobs/default.yaml (an empty file would "
            "silently train the built-in defaults)"
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"{p}: the top level must be a mapping of sections (job:, model:, ...); {KEYS_HINT}"
        )
    return data


def load(path: str | Path, overrides: list[str] | None = None) -> JobConfig:
    """Load a job YAML, apply ``section.key=value`` overrides, validate."""
    data = apply_overrides(load_yaml(path), overrides or [])
    return from_dict(data, source=str(path))
