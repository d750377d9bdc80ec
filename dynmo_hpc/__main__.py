"""Entry point of ``python -m dynmo_hpc`` and the ``dynmo-hpc`` console script.

The CLI's imports take about a second (h5py, matplotlib, pandas); a Ctrl-C during them ends
the command the way a Ctrl-C later does: the line ``interrupted`` and exit code 130, no
traceback.
"""

from __future__ import annotations

import sys


def main() -> int:
    """Import the CLI and run it; 130 when interrupted while importing."""
    try:
        from dynmo_hpc.cli import main as cli_main
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return cli_main()


if __name__ == "__main__":
    raise SystemExit(main())
