"""The probe: the largest micro-batch and context that really fit (found by trial), cached per
device, recipe and torch version, and kept in the run folder (probe.json, mirrored, signed) so that
a new VM of the same user on the same GPU and torch reads it instead of probing again. "GB" here is
GiB (2**30 bytes), as Colab and nvidia-smi count GPU memory.

The probe compiles nothing: its trials and timings run the trainer's step eagerly, so the training
step that follows compiles once, for its own micro-batch (compiling each timing kept `tinygpt probe
--hours 1` silent for over 200 s on an H100).
"""

from __future__ import annotations

import gc
import math
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from tinygpt.core.paths import cache_root
from tinygpt.core.precision import Precision, choose_precision, native_bf16, resolve_device
from tinygpt.core.recipes import Recipe
from tinygpt.core.rundir import PROBE_JSON, RunDir
from tinygpt.fit.hardware import cpu_name, ram_gb
from tinygpt.fit.memory import CUDA_CONTEXT_GB, GB
from tinygpt.fit.probe_cache import ProbeResult, cache_name, keep, read_kept
from tinygpt.fit.step_speed import SPEED_STEPS, compiled_speedup, trainer_speed
from tinygpt.fit.trials import (
    Trial,
    TrialRunner,
    batch_geometry,
    is_allocation_failure,
    largest_fit,
    speed_candidates,
)
from tinygpt.model.losses import default_chunk_rows
from tinygpt.train.decisions import own_signature

# the search and the timings stop here (the choice so far is kept, and said)
PROBE_TIME_LIMIT_S = 60.0
# what the probe chooses (with model.activation_checkpointing); a run keeps them when it resumes
PROBED_TRAIN_FIELDS = ("micro_batch_size", "grad_accum_steps", "seq_len", "precision", "loss")


class ProbeError(RuntimeError):
    """Nothing fits, not even micro-batch 1 at the shortest context with checkpointing."""


def requested_precision(
    recipe: Recipe, device_type: str, has_native_bf16: bool
) -> tuple[str, str | None]:
    """A recipe's bf16 on a GPU that emulates it (T4, V100) would be slow: the probe decides."""
    if recipe.train.precision == "bf16" and device_type == "cuda" and not has_native_bf16:
        return "auto", (
            f"recipe {recipe.name!r} asks for bf16, which this GPU only emulates: precision chosen "
            "by the probe"
        )
    return recipe.train.precision, None


def probe(
    recipe: Recipe,
    device: str | torch.device = "auto",
    *,
    precision: str | None = None,
    memory_limit_gb: float | None = None,
    margin: float = 0.1,
    measure: Callable[[int, int, bool], float] | None = None,
    max_micro_batch: int | None = None,
    min_seq_len: int = 128,
    time_limit_s: float | None = PROBE_TIME_LIMIT_S,
    cache_dir: str | Path | None = "default",
    run_dir: str | Path | None = None,
    speed: Callable[[Recipe, torch.device], float] | None = trainer_speed,
) -> ProbeResult:
    """Find by trial the largest micro-batch (then checkpointing, then a shorter context) that fits
    in (1 - margin) * memory_limit_gb, and the accumulation that keeps the recipe's tokens per step.

    `measure(micro_batch, seq_len, checkpointing) -> GB` replaces the real measurement (a trial over
    `memory_limit_gb` raises torch.OutOfMemoryError as a real one does). `cache_dir=None`: no cache;
    `run_dir`: the result is also kept there (probe.json), read back where this user signed it.
    `speed(recipe, device) -> tokens/s` picks the fastest micro-batch that fits (None: the largest);
    a timing that runs out of memory drops its candidate. After `time_limit_s` (None: no limit) the
    best found so far is taken."""
    dev = resolve_device(str(device))
    requested, prec_note = requested_precision(recipe, dev.type, native_bf16(dev))
    prec = choose_precision(dev, precision or requested)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{dev.type} {cpu_name()}"
    if memory_limit_gb is None:
        memory_limit_gb = _memory_limit(dev)
    # what a kept result must have been found for
    key = dict(
        device=name,
        recipe=recipe.name,
        torch=torch.__version__,
        model=recipe.model.to_dict(),
        seq_len=recipe.train.seq_len,
        micro_batch_size=recipe.train.micro_batch_size,
        tokens_per_step=recipe.train.tokens_per_step,
        precision=prec.name,
        memory_limit_gb=round(memory_limit_gb, 2),
        margin=margin,
        max_micro_batch=max_micro_batch,
        min_seq_len=min_seq_len,
        injected_measure=measure is not None,
        timed=getattr(speed, "__name__", None),
    )
    run_file = Path(run_dir) / PROBE_JSON if run_dir is not None else None
    folder = cache_root("probe") if cache_dir == "default" else cache_dir
    paths = [] if folder is None else [Path(folder) / cache_name(key)]
    kept = read_kept(paths, key, run_file)
    if kept is not None:
        return kept
    search = _Search(recipe, dev, prec, memory_limit_gb, margin, measure, time_limit_s)
    cap = max_micro_batch or 4 * recipe.train.micro_batch_size
    result = search.run(cap, min_seq_len, speed, prec_note, name, key)
    for path in [*paths, *([run_file] if run_file is not None else [])]:
        keep(path, result)
    return result


def _memory_limit(dev: torch.device) -> float:
    """The memory a probe may fill by default: the GPU's less its context, or the free RAM."""
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[1] / GB - CUDA_CONTEXT_GB
    return ram_gb()[1] or math.inf


def _fit_notes(recipe: Recipe, t: int, ckpt: bool, prec_note: str | None) -> list[str]:
    """What the search changed to fit (context `t`, checkpointing `ckpt`) and the precision's note."""
    notes = [n for n in [prec_note] if n]
    if ckpt and not recipe.model.activation_checkpointing:
        notes.append(
            "activation checkpointing turned on: micro-batch 1 did not fit without it at context "
            f"{t}"
        )
    if t < recipe.train.seq_len:
        notes.append(
            f"context shortened from {recipe.train.seq_len} to {t}: micro-batch 1 did not fit at "
            "longer contexts even with activation checkpointing"
        )
    return notes


class _Search:
    """One probe's search: memory trials, then timings of the trainer's step, in one time limit."""

    def __init__(
        self,
        recipe: Recipe,
        dev: torch.device,
        prec: Precision,
        limit_gb: float,
        margin: float,
        measure: Callable | None,
        time_limit_s: float | None,
    ):
        self.recipe, self.dev, self.prec = recipe, dev, prec
        self.limit_gb, self.margin, self.measure = limit_gb, margin, measure
        self.time_limit_s, self.t0 = time_limit_s, time.perf_counter()
        self.runner = TrialRunner(recipe, dev, prec, limit_gb, margin, measure)
        self.trials: list[Trial] = []
        self.notes: list[str] = []
        self.speeds: dict[tuple[int, str], float] = {}

    def run(
        self,
        cap: int,
        min_seq_len: int,
        speed: Callable | None,
        prec_note: str | None,
        name: str,
        key: dict,
    ) -> ProbeResult:
        """The largest fit up to `cap`, the fastest by `speed` (None: the largest), confirmed."""
        t, ckpt, largest = self.largest_fit(cap, min_seq_len)
        self.notes += _fit_notes(self.recipe, t, ckpt, prec_note)
        limit, loss = largest, self.recipe.train.loss
        if speed is not None:
            limit, loss = self.fastest(speed, largest, t, ckpt)
        return self.confirm(limit, loss, largest, t, ckpt, name, key)

    def out_of_time(self) -> bool:
        return self.time_limit_s is not None and time.perf_counter() - self.t0 > self.time_limit_s

    def fits(self, b: int, t: int, ckpt: bool) -> bool:
        self.trials.append(self.runner.trial(b, t, ckpt))
        return self.trials[-1].ok

    def largest_fit(self, cap0: int, min_seq_len: int) -> tuple[int, bool, int]:
        """(context, checkpointing, largest micro-batch): the recipe's context first, without
        checkpointing first (unless the recipe has it on), halving the context only when micro-batch
        1 does not fit."""
        train = self.recipe.train
        lengths = [train.seq_len]
        while lengths[-1] // 2 >= min_seq_len:
            lengths.append(lengths[-1] // 2)
        ckpts = [True] if self.recipe.model.activation_checkpointing else [False, True]
        for t in lengths:
            for ckpt in ckpts:
                largest = largest_fit(
                    lambda b: self.fits(b, t, ckpt),
                    max(1, min(cap0, train.tokens_per_step // t)),
                    self.out_of_time,
                )
                if largest:
                    return t, ckpt, largest
        raise ProbeError(
            f"recipe {self.recipe.name!r} does not fit in {self.limit_gb:.1f} GB (margin "
            f"{self.margin:.0%}) even at micro-batch 1, context {lengths[-1]}, with activation "
            "checkpointing: pick a smaller recipe"
        )

    def fastest(self, speed: Callable, largest: int, t: int, ckpt: bool) -> tuple[int, str]:
        """(micro-batch, loss): the fastest of those that fit, as the trainer runs them (on an H100
        the largest was not the fastest). Where the recipe's loss would chunk the logits, the full
        logits are timed too if they fit (chunking cost 12-13% on an H100 where they fitted)."""
        train, vocab = self.recipe.train, self.recipe.model.vocab_size
        # (micro-batch, accumulation, loss) to time, in this order
        timings: list[tuple[int, int, str]] = []
        for micro, accum in speed_candidates(largest, t, train.tokens_per_step):
            timings.append((micro, accum, train.loss))
            chunked = train.loss == "auto" and default_chunk_rows(micro * t, vocab)
            if chunked and not self.out_of_time():
                self.runner.loss = "full"
                full_fits = self.fits(micro, t, ckpt)
                self.runner.loss = train.loss
                if full_fits:
                    timings.append((micro, accum, "full"))
        self.runner = None  # the trial model's memory goes back before the trainers' is taken
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()
        for micro, accum, mode in timings:
            if self.speeds and self.out_of_time():
                break
            self._time(speed, micro, accum, mode, t, ckpt)
        self.runner = TrialRunner(
            self.recipe, self.dev, self.prec, self.limit_gb, self.margin, self.measure
        )
        # every timing ran out of memory: the smallest candidate, whose memory trial passed
        limit, loss = max(self.speeds, key=self.speeds.get, default=(timings[-1][0], train.loss))
        self.runner.loss = loss
        if len(self.speeds) > 1:
            timed = sorted(self.speeds.items())
            listed = ", ".join(f"{_speed_key(*k)}: {v:,.0f} tokens/s" for k, v in timed)
            full = " with the full logits" if loss == "full" else ""
            self.notes.append(
                f"micro-batch {limit}{full} is the fastest of those timed as the trainer runs "
                f"them ({listed})"
            )
        return limit, loss

    def _time(self, speed: Callable, micro: int, accum: int, mode: str, t: int, ckpt: bool) -> None:
        train = {"micro_batch_size": micro, "seq_len": t, "grad_accum_steps": accum}
        train |= {"precision": self.prec.name, "loss": mode}
        recipe = self.recipe.replace(model={"activation_checkpointing": ckpt}, train=train)
        try:
            self.speeds[(micro, mode)] = speed(recipe, self.dev)
        except Exception as e:
            if not is_allocation_failure(e):
                raise
            self.notes.append(
                f"micro-batch {_speed_key(micro, mode)} dropped: the trainer's step ran out of "
                f"memory ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
            )

    def confirm(
        self, limit: int, loss: str, largest: int, t: int, ckpt: bool, name: str, key: dict
    ) -> ProbeResult:
        """The chosen geometry confirmed by one more (warm) trial, whose peak is reported."""
        tokens_per_step = self.recipe.train.tokens_per_step
        while True:
            micro, accum, geometry_note = batch_geometry(limit, t, tokens_per_step)
            if self.fits(micro, t, ckpt) or micro == 1:
                break
            limit = micro - 1
        if geometry_note:
            self.notes.append(geometry_note)
        if micro < largest and not geometry_note:
            self.notes.append(
                f"micro-batch {micro} (up to {largest} fits) so that {micro} x {accum} steps x {t} "
                f"tokens is exactly the recipe's {tokens_per_step} tokens per step"
            )
        if self.out_of_time():
            self.notes.append(
                f"the search stopped at its time limit of {self.time_limit_s:.0f} s: a larger "
                "micro-batch may fit"
            )
        self.notes.append("memory measured in eager mode; torch.compile usually needs less")
        final = self.trials[-1]
        tps, source = final.tokens_per_s, "measured by trial (eager, one micro-batch)"
        if (micro, loss) in self.speeds:
            tps = self.speeds[(micro, loss)]
            source = f"measured: the trainer's step (eager), median of {SPEED_STEPS}"
        if (up := compiled_speedup(self.recipe.train.compile, self.dev)) != 1.0:
            tps *= up
            source += f"; x{up:.2f} for compiling (compiled over eager, docs/BENCHMARKS.md §5)"
        return ProbeResult(
            self.recipe.name,
            name,
            micro,
            t,
            accum,
            ckpt,
            self.prec.name,
            self.prec.reason,
            final.peak_gb if final.peak_gb is not None else math.nan,
            self.limit_gb,
            self.margin,
            largest,
            tps,
            time.perf_counter() - self.t0,
            self.notes,
            self.trials,
            key,
            speeds={_speed_key(*k): v for k, v in self.speeds.items()},
            tokens_per_s_source=source,
            loss=loss,
            time_limit_s=self.time_limit_s,
        )


def _speed_key(micro: int, loss: str) -> str:
    return f"{micro} full" if loss == "full" else str(micro)


def apply_probe(recipe: Recipe, result: ProbeResult) -> Recipe:
    """The recipe with the probe's decisions (PROBED_TRAIN_FIELDS, activation checkpointing)."""
    return recipe.replace(
        model={"activation_checkpointing": result.activation_checkpointing},
        train={k: getattr(result, k) for k in PROBED_TRAIN_FIELDS},
    )


def fit_to_device(
    recipe: Recipe, run_dir: Path, dev: torch.device, world_size: int = 1, trusted: bool = False
) -> tuple[Recipe, dict | None]:
    """(the recipe with the probe's decisions on a GPU, the probe's result). A resumed run keeps the
    decisions it started with where this user signed its run.json (`trusted`: rank 0 wrote it for
    this job); any other run.json (a shared mirror's) decides none of them: this machine probes, and
    on a CPU the recipe stands as written."""
    run = RunDir(run_dir)
    old = run.info() if run.is_pretrain_run() else {}
    if old.get("probe") and (trusted or own_signature(old)):
        return _kept_choices(recipe, old, dev), old["probe"]
    if dev.type != "cuda" or world_size > 1:
        return recipe, None
    result = probe(recipe, device=dev, run_dir=run_dir)
    return apply_probe(recipe, result), result.to_dict()


def _kept_choices(recipe: Recipe, old: dict, dev: torch.device) -> Recipe:
    """`recipe` with the probed fields of its own run.json (`old`); a warning on another GPU."""
    r = old["recipe"]
    # (a CUDA device with no CUDA runtime is only a test's: there is no name to compare)
    on_gpu = dev.type == "cuda" and torch.cuda.is_available()
    was, now = old["probe"].get("device_name"), torch.cuda.get_device_name(dev) if on_gpu else None
    if now is not None and was != now:
        warnings.warn(
            f"this run was probed on a {was} and resumes on a {now}: it keeps micro-batch "
            f"{r['train']['micro_batch_size']}, context {r['train']['seq_len']} and "
            f"precision {r['train']['precision']}; if it runs out of memory, start a new "
            "run folder",
            stacklevel=3,
        )
    return recipe.replace(
        train={k: r["train"][k] for k in PROBED_TRAIN_FIELDS if k in r["train"]},
        model={"activation_checkpointing": r["model"]["activation_checkpointing"]},
    )
