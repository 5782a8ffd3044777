"""Where start-up time goes: the seconds from the start of a run to its first training step, by
phase, printed and recorded in metrics.jsonl as {"step": N, "startup": {...}} (a resumed run
records its own). Each phase is the time since the previous mark.
"""

from __future__ import annotations

import sys
import time

import torch


def compile_seconds() -> float:
    """Seconds torch's compiler has spent in this process so far (0 when it was never used)."""
    # never imported: nothing compiled (and importing it costs ~1 s)
    if "torch._dynamo" not in sys.modules:
        return 0.0
    try:
        metrics = torch._dynamo.utils.compilation_time_metrics  # a private table: read defensively
        return float(sum(metrics.get("_compile.compile_inner", [])))
    except Exception:
        return 0.0


class StartupClock:
    """Phases of a start-up, in the order marked (restore, probe, tokenizer, data, model, ...)."""

    def __init__(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.compile_s0 = compile_seconds()
        self.notes: list[str] = []

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now

    def record(self) -> dict:
        """Seconds per phase, the compile time inside the first step, and the total."""
        out = {f"{k}_s": round(v, 3) for k, v in self.phases.items()}
        out["compile_s"] = round(compile_seconds() - self.compile_s0, 3)
        out["total_s"] = round(self.last - self.t0, 3)
        if self.notes:
            out["notes"] = list(self.notes)
        return out

    def summary(self) -> str:
        r = self.record()
        parts = [
            f"{k[:-2].replace('_', ' ')} {v:.1f} s"
            for k, v in r.items()
            if k not in ("total_s", "compile_s", "notes")
        ]
        if r["compile_s"]:
            parts.append(f"of which compile {r['compile_s']:.1f} s")
        return (
            f"start-up {r['total_s']:.1f} s to the first step: "
            + ", ".join(parts)
            + "".join(f"; {n}" for n in self.notes)
        )
