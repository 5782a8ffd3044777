"""Figures as a person reads them in a table or a message: counts,
durations, memory sizes. One place, so every table picks units the
same way and none shows "0.0M" or "0 s" for a real, non-zero value."""

from __future__ import annotations


def count(n: float) -> str:
    """A count (tokens, parameters): 512, 15.4k, 614k, 1.3M, 5.2B."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def duration(seconds: float | None) -> str:
    """A time in the unit that shows it: "0.4 s", "12 s", "8 min", "2.5 h"; "-" for None."""
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.2g} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:,.1f} h"


def size_gb(gb: float) -> str:
    """A memory size given in GB: "12 MB" below a GB, "3.2 GB" above."""
    if gb < 1:
        mb = gb * 1024
        return f"{mb:.2g} MB" if mb < 10 else f"{mb:.0f} MB"
    return f"{gb:.1f} GB"
