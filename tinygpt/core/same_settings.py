"""The one "is this the same run?" check: two configurations (nested dicts) compared key by key,
their differences in words (`config_differences`), and the refusal to continue a run folder
started otherwise (`check_same_settings`), shared by pretraining, finetuning and the trainer."""

from __future__ import annotations

from pathlib import Path

from tinygpt.core.config import ConfigError


def config_differences(
    old: dict, new: dict, allowed: set[str] | frozenset = frozenset(), prefix: str = ""
) -> list[str]:
    """Human-readable differences between two config dicts (nested), ignoring the `allowed` keys."""
    out = []
    for k in sorted(set(old) | set(new)):
        if k in allowed:
            continue
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, allowed, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} in the run, {b!r} now")
    return out


def check_same_settings(
    where: str | Path,
    old: dict | None,
    new: dict,
    what: str = "a different configuration",
    allowed: set[str] | frozenset = frozenset(),
) -> None:
    """The one "is this the same run?" check of pretraining, finetuning and the trainer: refuse to
    continue `where` when `old` (what it was started with) and `new` differ beyond `allowed`."""
    diffs = config_differences(old, new, allowed) if old is not None else []
    if diffs:
        raise ConfigError(
            f"{where} holds {what}:\n  "
            + "\n  ".join(diffs)
            + "\nuse another run folder (a new --run-dir or RUN_NAME), or the same settings to "
            "resume"
        )
