"""The load-report cycle's two rules, shared by the trainer, the schemes and the simulator.

- :func:`is_report_step`: a load report follows every ``balance.interval``-th step and the last.
- :func:`smooth_costs`: each report's per-layer costs enter an exponential moving average.

Pure functions of numbers, with no package imports, so every layer can use the one definition.
"""

from __future__ import annotations

from collections.abc import Sequence


def is_report_step(step: int, interval: int, num_steps: int) -> bool:
    """True when a load report follows step ``step`` (0-based): every ``interval`` steps, and
    after the last of ``num_steps``.

    Example: ``interval=5, num_steps=12`` reports after steps 4, 9 and 11.
    """
    return (step + 1) % interval == 0 or step + 1 == num_steps


def smooth_costs(
    latest: Sequence[float], previous: Sequence[float] | None, smoothing: float
) -> list[float]:
    """The moving average after one more report: ``smoothing * latest + (1 - smoothing) *
    previous`` per layer; ``latest`` itself for the first report (``previous`` None).

    ``smoothing`` is the newest report's weight, in (0, 1]: 1.0 keeps no memory.
    """
    if previous is None:
        return list(latest)
    a = smoothing
    return [a * new + (1 - a) * old for new, old in zip(latest, previous, strict=True)]
