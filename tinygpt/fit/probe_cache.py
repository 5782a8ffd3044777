"""The probe's result (`ProbeResult`) and where it is kept: the user's cache, one file per device,
recipe and torch version, and the run folder's probe.json, signed with this user's key
(`decisions`); a probe.json this user did not sign (a shared mirror's) is a record, never read. A
kept result is read back only for exactly the same key, its values checked, and written whole or
not at all."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tinygpt.core.files import read_json_safe, write_json_atomic
from tinygpt.core.rundir import PROBE_JSON
from tinygpt.fit.trials import Trial
from tinygpt.train.decisions import own_signature, sign

PROBE_DOMAIN = "probe"  # what probe.json's signature covers: the whole result
PRECISIONS = ("bf16", "fp16", "fp32")
LOSSES = ("auto", "full", "chunked")
MAX_PROBED = 1 << 20  # no micro-batch, accumulation or context of any recipe is larger


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
    def from_dict(cls, d: dict, where: str = PROBE_JSON) -> "ProbeResult":
        """A kept result, its values checked: anything tinygpt could not have written (a type, a
        count out of range, an unknown precision or loss) is a ValueError in one line naming
        `where`, the file it came from."""
        d = {k: v for k, v in d.items() if k != "signature"} if isinstance(d, dict) else d
        why = _problem(d)
        if why is not None:
            raise ValueError(
                f"{where} is not a probe result tinygpt wrote ({why}): delete it, "
                "the probe runs again"
            )
        return cls(**{**d, "trials": [Trial(**t) for t in d.get("trials", [])]})


def _whole(v: object) -> bool:
    return type(v) is int and 1 <= v <= MAX_PROBED


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf")


def _problem(d: object) -> str | None:
    """Why `d` cannot be a ProbeResult tinygpt wrote (None when it can)."""
    if not isinstance(d, dict):
        return "not a JSON object"
    fields = {f.name for f in ProbeResult.__dataclass_fields__.values()}
    if unknown := sorted(set(d) - fields):
        return f"unknown field {unknown[0][:40]!r}"
    whole = ("micro_batch_size", "seq_len", "grad_accum_steps", "largest_micro_batch")
    text = ("recipe", "device_name", "precision_reason", "tokens_per_s_source")
    checks = {
        **dict.fromkeys(whole, _whole),
        "activation_checkpointing": lambda v: isinstance(v, bool),
        "precision": lambda v: v in PRECISIONS,
        "loss": lambda v: v in LOSSES,
        "peak_gb": _number,
        "memory_limit_gb": lambda v: _number(v) or v == float("inf"),
        "margin": lambda v: _number(v) and v < 1,
        "search_s": _number,
        **dict.fromkeys(("tokens_per_s", "time_limit_s"), lambda v: v is None or _number(v)),
        **dict.fromkeys(text, lambda v: isinstance(v, str)),
        "notes": lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v),
        "key": lambda v: isinstance(v, dict),
        "from_cache": lambda v: isinstance(v, bool),
        "speeds": lambda v: isinstance(v, dict) and all(_number(x) for x in v.values()),
        "trials": lambda v: isinstance(v, list) and all(_trial(t) for t in v),
    }
    for name, ok in checks.items():
        if name in d and not ok(d[name]):
            return f"{name} {str(d[name])[:40]!r}"
    missing = [
        f.name
        for f in ProbeResult.__dataclass_fields__.values()
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in d
    ]
    return f"no {missing[0]}" if missing else None


def _trial(t: object) -> bool:
    names = {f.name for f in dataclasses.fields(Trial)}
    return (
        isinstance(t, dict)
        and set(t) == names
        and _whole(t["micro_batch"])
        and _whole(t["seq_len"])
        and all(isinstance(t[k], bool) for k in ("checkpointing", "ok", "oom"))
        and all(t[k] is None or _number(t[k]) for k in ("peak_gb", "tokens_per_s"))
    )


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", s).strip("-")


def cache_name(key: dict) -> str:
    """The user cache's file for a key: named by its device, recipe and torch version; the rest
    of the key is compared inside (a result kept for other settings is searched again)."""
    return f"{_slug(key['device'])}__{_slug(key['recipe'])}__torch-{_slug(key['torch'])}.json"


def read_kept(paths: list[Path], key: dict, run_file: Path | None = None) -> ProbeResult | None:
    """The first kept result for exactly this key: this machine's cache (`paths`), then the run
    folder's probe.json (`run_file`) only where this user signed it; copied to where it was missing.
    A cache file that is not one is searched again."""
    own = [run_file] if run_file is not None else []
    for path in [*paths, *own]:
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            d = read_json_safe(path)
            if path in own and not own_signature(d, PROBE_DOMAIN):
                continue
            cached = ProbeResult.from_dict(d, str(path))
            if cached.key == json.loads(json.dumps(key)):
                cached.from_cache = True
                for other in [*paths, *own]:
                    if not other.is_file():
                        keep(other, cached)
                return cached
    return None


def keep(path: Path, result: ProbeResult) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # a disconnect never leaves half a file
    write_json_atomic(path, sign({**result.to_dict(), "from_cache": False}, PROBE_DOMAIN))
