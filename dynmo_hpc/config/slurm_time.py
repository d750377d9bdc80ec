"""SLURM's ``--time`` formats, read into whole minutes.

Why here and not left to sbatch: ``slurm.time_min`` feeds the preemption-signal check
(``signal_delay_s`` < the limit) and submitit, which both need a number; and YAML 1.1 would read
``1:00:00`` as 3600 (our loader keeps it a string, this parses it).
"""

from __future__ import annotations

import math
import re

from dynmo_hpc.errors import ConfigError

MAX_TIME_MIN = 365 * 24 * 60
"""A year; no cluster grants more, and a larger value is a unit mistake (seconds for minutes)."""

_FORMATS = (
    # (pattern, names of the groups in order); seconds round up to the next minute.
    (re.compile(r"(\d+)", re.ASCII), ("minutes",)),
    (re.compile(r"(\d+):(\d\d?)", re.ASCII), ("minutes", "seconds")),
    (re.compile(r"(\d+):(\d\d?):(\d\d?)", re.ASCII), ("hours", "minutes", "seconds")),
    (re.compile(r"(\d+)-(\d\d?)", re.ASCII), ("days", "hours")),
    (re.compile(r"(\d+)-(\d\d?):(\d\d?)", re.ASCII), ("days", "hours", "minutes")),
    (
        re.compile(r"(\d+)-(\d\d?):(\d\d?):(\d\d?)", re.ASCII),
        ("days", "hours", "minutes", "seconds"),
    ),
)
_SECONDS = {"days": 86400, "hours": 3600, "minutes": 60, "seconds": 1}
_LIMIT = {"hours": 24, "minutes": 60, "seconds": 60}
"""A field after the first is bounded like a clock (SLURM rejects ``1:75``); the first is not."""

FORMATS_TEXT = '"MM", "MM:SS", "HH:MM:SS", "D-HH", "D-HH:MM", "D-HH:MM:SS" or whole minutes'


def slurm_time_minutes(text: str, key: str = "slurm.time_min") -> int:
    """``"1:30:00"`` -> 90; ``"2-00"`` -> 2880; ``"0:30"`` -> 1 (rounded up to a minute).

    Raises:
        ConfigError: not one of SLURM's formats, a clock field out of range, or a limit under a
            minute or over :data:`MAX_TIME_MIN`.
    """
    value = text.strip()
    for pattern, names in _FORMATS:
        match = pattern.fullmatch(value)
        if match is None:
            continue
        fields = [int(g) for g in match.groups()]
        for position, (name, number) in enumerate(zip(names, fields, strict=True)):
            if position and number >= _LIMIT[name]:
                raise ConfigError(
                    f"{key}={text!r}: {name} {number} must be < {_LIMIT[name]}; HINT: write "
                    f"{FORMATS_TEXT}"
                )
        total_s = sum(_SECONDS[name] * number for name, number in zip(names, fields, strict=True))
        minutes = math.ceil(total_s / 60)
        check_minutes(key, minutes, shown=repr(text))
        return minutes
    raise ConfigError(
        f"{key}={text!r} is not a SLURM time limit; HINT: write {FORMATS_TEXT} (quote values "
        'with a colon: "1:00:00")'
    )


def check_minutes(key: str, minutes: int, shown: str | None = None) -> None:
    """Refuse a limit under one minute or over a year."""
    if not 1 <= minutes <= MAX_TIME_MIN:
        raise ConfigError(
            f"{key}={shown or minutes} is {minutes} minutes; it must be in [1, {MAX_TIME_MIN}] "
            '(a year); HINT: give the limit in minutes, or as "HH:MM:SS"'
        )
