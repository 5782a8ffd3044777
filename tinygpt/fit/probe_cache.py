"""The probe's result (`ProbeResult`) and where it is kept: the run folder's probe.json (mirrored
with the run, so a new VM on the same GPU and torch reads it instead of probing again) and the
user's cache, one file per device, recipe and torch version (`cache_name`). A kept result is read
back only for exactly the same key (`read_kept`), and written whole or not at all (`keep`)."""
from __future__ import annotations

import contextlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tinygpt.core.files import read_json_safe, write_json_atomic
from tinygpt.fit.trials import Trial


@dataclass
class ProbeResult:
    recipe: str
    device_name: str
    micro_batch_size: int
    seq_len: int
    grad_accum_steps: int
    activation_checkpointing: bool
    precision: str
    precision_reason: str
    peak_gb: float
    memory_limit_gb: float
    margin: float
    largest_micro_batch: int  # before rounding to a divisor of the global batch
    tokens_per_s: float | None
    search_s: float
    notes: list[str] = field(default_factory=list)
    trials: list[Trial] = field(default_factory=list)
    key: dict = field(default_factory=dict)
    from_cache: bool = False
    # "micro-batch" or "micro-batch full" -> tokens/s of the trainer's step
    speeds: dict = field(default_factory=dict)
    tokens_per_s_source: str = "measured by trial (eager, one micro-batch)"
    # the loss the trainer takes: "full" logits where they fit and measured faster
    loss: str = "auto"
    time_limit_s: float | None = None  # the search's time limit

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ProbeResult":
        return cls(**{**d, "trials": [Trial(**t) for t in d.get("trials", [])]})


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", s).strip("-")


def cache_name(key: dict) -> str:
    """The user cache's file for a key: named by its device, recipe and torch version; the rest
    of the key is compared inside (a result kept for other settings is searched again)."""
    return f"{_slug(key['device'])}__{_slug(key['recipe'])}__torch-{_slug(key['torch'])}.json"


def read_kept(paths: list[Path], key: dict) -> ProbeResult | None:
    """The first kept result for exactly this key (the run folder's, then the user's cache); it is
    copied to where it was missing (the run keeps what the user's cache had, and the other way
    round)."""
    for path in paths:
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            # probe.json comes back from a mirror too
            cached = ProbeResult.from_dict(read_json_safe(path))
            if cached.key == json.loads(json.dumps(key)):
                cached.from_cache = True
                for other in paths:
                    if not other.is_file():
                        keep(other, cached)
                return cached
    return None


def keep(path: Path, result: ProbeResult) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # a disconnect never leaves half a file
    write_json_atomic(path, {**result.to_dict(), "from_cache": False})
