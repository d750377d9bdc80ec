"""The one YAML reader for job files, ``--set`` and ``--sweep`` values: safe, strict, YAML 1.2-ish.

Why its own loader instead of ``yaml.safe_load``:

* **No sexagesimal numbers.** YAML 1.1 reads ``1:00:00`` as the integer 3600 and ``1:30`` as
  90, so ``slurm.time_min: 1:00:00`` would silently ask SLURM for 60 hours. Here such scalars
  stay strings, and the key that takes them (``slurm.time_min``) parses SLURM's time formats.
* **No duplicate keys.** YAML keeps the last one silently; one of the two was a mistake.
* **No aliases.** A few hundred bytes of nested ``*name`` aliases expand to gigabytes.
* **Only scalar keys**, and nesting bounded by Python's recursion limit, so hostile text ends in
  a :class:`~dynmo_hpc.errors.ConfigError`, never a ``TypeError`` or ``RecursionError``.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from typing import Any

import yaml

from dynmo_hpc.errors import ConfigError

_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"

_INT_NO_SEXAGESIMAL = re.compile(
    r"""^(?:[-+]?0b[01_]+
    |[-+]?0[0-7_]+
    |[-+]?(?:0|[1-9][0-9_]*)
    |[-+]?0x[0-9a-fA-F_]+)$""",
    re.VERBOSE,
)
"""YAML 1.1 integers (binary, octal, decimal, hex) without the base-60 form ``1:30``."""

_FLOAT_NO_SEXAGESIMAL = re.compile(
    r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+][0-9]+)?
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.VERBOSE,
)
"""YAML 1.1 floats without the base-60 form ``1:30.5`` (NaN/inf are read, and refused later
with a message naming the key)."""


class StrictLoader(yaml.SafeLoader):  # type: ignore[misc]  # yaml ships no stubs here
    """``yaml.SafeLoader`` without base-60 numbers, duplicate keys, aliases or non-scalar keys."""

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
            if not isinstance(key, Hashable):
                raise yaml.YAMLError(
                    f"a mapping key is a {type(key).__name__} {key_node.start_mark}; "
                    "HINT: keys are plain names such as steps"
                )
            if key in seen:
                raise yaml.YAMLError(
                    f"duplicate key {key!r} {key_node.start_mark}; HINT: keep one of them"
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _without_sexagesimal() -> dict[Any, list[tuple[str, re.Pattern[str]]]]:
    """SafeLoader's implicit resolvers with the int and float ones replaced (same first chars)."""
    table: dict[Any, list[tuple[str, re.Pattern[str]]]] = {}
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items():
        kept = []
        for tag, pattern in resolvers:
            if tag == _INT_TAG:
                pattern = _INT_NO_SEXAGESIMAL
            elif tag == _FLOAT_TAG:
                pattern = _FLOAT_NO_SEXAGESIMAL
            kept.append((tag, pattern))
        table[first] = kept
    return table


StrictLoader.yaml_implicit_resolvers = _without_sexagesimal()


def _one_line(exc: yaml.YAMLError) -> str:
    """PyYAML's messages span lines (problem, mark, context); an ``error:`` line is one line."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def parse_yaml(text: str, what: str, hint: str = "check the indentation and quoting there") -> Any:
    """``text`` as plain data (dicts, lists, scalars); ``what`` names its origin in errors,
    ``hint`` is the fix suggested for a syntax error.

    Raises:
        ConfigError: invalid or hostile YAML (the message is one line and ends with a HINT).
    """
    try:
        return yaml.load(text, Loader=StrictLoader)
    except yaml.YAMLError as exc:
        message = _one_line(exc)
        fix = "" if "HINT:" in message else f"; HINT: {hint}"
        raise ConfigError(f"{what}: not valid YAML: {message}{fix}") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits (CPython's limit)
        raise ConfigError(
            f"{what}: a value cannot be read ({exc}); HINT: a typo? no job setting is that large"
        ) from None
    except RecursionError:
        raise ConfigError(
            f"{what}: the YAML is nested too deeply to be a job file; HINT: a job file has "
            "sections of keys, a few levels deep"
        ) from None
