"""The command line that wrote a benchmark's JSON, from the ``args`` it records."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def benchmark_command(script: str, flags: Sequence[str], args: dict[str, Any]) -> str:
    """``python <script> --flag value ... --json <path>`` for the ``flags`` recorded in ``args``
    (a list value as its items separated by spaces)."""
    parts = [f"--{k.replace('_', '-')} " + (" ".join(map(str, args[k])) if isinstance(args[k], list)
                                            else str(args[k])) for k in flags]
    return f"python {script} {' '.join(parts)} --json {args['json']}"
