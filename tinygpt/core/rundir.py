"""A run folder: the one place that knows its file names and formats.

    runs/<name>/
      run.json          the recipe, precision, device, data, probe decisions, versions (written by pretrain)
      tokenizer.json    kept once written: a resumed run must tokenize the same way
      identity.json     the run's id and configuration hash; its mirror holds the same (one run per mirror)
      metrics.jsonl     one JSON object per logged step (a killed run may leave the last line cut short)
      samples.txt       text sampled at intervals
      evals.jsonl       each evaluation of the run (`tinygpt eval`), one JSON object per line
      finetune.json     a finetuning run's settings (instead of run.json)
      adapter_config.json, tinygpt_finetune.json, adapter/   a finetuning run's PEFT adapter
      model/            a full finetuning run's result (config.json, model.safetensors, tokenizer)
      checkpoints/step_NNNNNN/   model.safetensors, state.pt, manifest.json (see core.checkpoint)
      best/             the checkpoint with the lowest validation loss
      plots/, tensorboard/   pictures and TensorBoard logs

Every reader of these files goes through `RunDir`, so a cut-off line or a garbage file gets the same
one-line error everywhere, naming the file and what to do.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinygpt.core.config import ConfigError
from tinygpt.core.files import (
    RUN_FILE_LIMIT,
    append_text,
    read_json_safe,
    read_text_safe,
    write_json_atomic,
    write_text_atomic,
)
from tinygpt.core.recipes import Recipe

RUN_JSON, TOKENIZER_JSON = "run.json", "tokenizer.json"
METRICS, SAMPLES = "metrics.jsonl", "samples.txt"
SAMPLE_HEADING = "=== step {step} ==="  # each sample in samples.txt begins with this line
# a step in a heading: 1 to 12 ASCII digits (`\d` takes
# other scripts' digits, and a 5000-digit number is no step)
_SAMPLE_HEADINGS = re.compile(
    "^" + re.escape(SAMPLE_HEADING).replace(re.escape("{step}"), r"([0-9]{1,12})") + "$", re.M
)
FINETUNE_JSON, ADAPTER_CONFIG = "finetune.json", "adapter_config.json"
ADAPTER_INFO, ADAPTER_DIR = "tinygpt_finetune.json", "adapter"
CHECKPOINTS, BEST = "checkpoints", "best"
PLOTS, TENSORBOARD = "plots", "tensorboard"  # pictures of the run; TensorBoard's event files
# beside the mirrored run folders: the token cache's shards, shared by runs
TOKEN_CACHE = "_token_cache"
LOCK = ".lock"  # held by the one process writing the run folder (never mirrored)
# the run's id and configuration hash, in the run folder and its mirror (one run per mirror)
IDENTITY = "identity.json"
# a finetuning run's exported tinygpt base; its merged model
BASE_DIR, MERGED_DIR = "base", "merged"
# a full finetuning run's result: config.json, model.safetensors, tokenizer
FULL_MODEL_DIR = "model"
# each evaluation of a run, recorded in its folder (the model card lists them)
EVALS_JSONL = "evals.jsonl"
BUDGET_JSON = "budget.json"  # a time budget's step count, fixed once (tinygpt pretrain --hours)
# the compiler's artifacts (signed): a new VM on the same GPU compiles less
COMPILE_CACHE = "compile_cache.bin"
# the probe's result: a new VM on the same GPU and torch does not probe again
PROBE_JSON = "probe.json"
# the small files a mirror keeps beside the checkpoints
# (everything a run needs to resume or be read)
RUN_FILES = (
    RUN_JSON,
    TOKENIZER_JSON,
    METRICS,
    SAMPLES,
    FINETUNE_JSON,
    ADAPTER_CONFIG,
    ADAPTER_INFO,
    COMPILE_CACHE,
    BUDGET_JSON,
    PROBE_JSON,
)

COMPILE_CACHE_LIMIT = 1 << 30  # the compiler's artifacts of the largest recipe are tens of MB


def run_file_limit(name: str) -> int:
    """The most bytes tinygpt reads of a run file (`files.read_bytes_safe`):
    a larger one, on a shared mirror above all, was not written by tinygpt
    and is refused, named, before it is read or copied."""
    return {METRICS: METRICS_LIMIT, COMPILE_CACHE: COMPILE_CACHE_LIMIT}.get(name, RUN_FILE_LIMIT)


def recipe_name_of(*run_dirs: str | Path | None) -> str | None:
    """The recipe name in the first of these run folders (local, mirror ...) that has one."""
    return next(
        (n for d in run_dirs if d is not None and (n := RunDir(d).recipe_name()) is not None), None
    )


class RunDirError(ValueError):
    """A run folder's file is missing or unreadable; the message names the file and what to do."""


def closest_run(path: str | Path) -> Path | None:
    """The existing run folder (pretraining or finetuning) beside `path`
    whose name is closest to its name, for a mistyped path; None when no
    run folder there has a similar name. Never `path` itself."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        return None
    runs = {
        p.name: p
        for p in parent.iterdir()
        if p.name != path.name and (RunDir(p).is_pretrain_run() or RunDir(p).is_finetune_run())
    }
    best = difflib.get_close_matches(path.name, list(runs), n=1, cutoff=0.6)
    return runs[best[0]] if best else None


def missing_run_message(path: str | Path) -> str:
    """One line for a run folder that does not exist: the closest existing run folder, if any, as
    the fix (never the mistyped path again)."""
    near = closest_run(path)
    if near is not None:
        return f"no run folder at {path}; did you mean {near}?"
    return (
        f"no run folder at {path} (none beside it has a similar name); check the path, or train "
        "one with `tinygpt pretrain`"
    )


class RunDirReplaced(RunDirError):
    """The run folder this process holds was deleted or replaced (e.g. `rm -rf run; mkdir run` in
    another tab) while it ran: it writes nothing into the new folder, which may be another run's."""


# The folders this process holds the lock of: absolute path -> (st_dev, st_ino) of the folder when
# it was locked. The lock is bound to that identity, not to the path: see RunDir.check_held.
_HELD: dict[str, tuple[int, int]] = {}
_HELD_LOCK = threading.Lock()


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def read_json(path: str | Path, what: str = "") -> Any:
    """A JSON file, read the one way a run file is read
    (`files.read_json_safe`: no link, no hard-linked file, no FIFO, at most
    RUN_FILE_LIMIT bytes), or a one-line RunDirError that names it."""
    path = Path(path)
    try:
        return read_json_safe(path)
    except FileNotFoundError:
        raise RunDirError(f"{path} does not exist{what}") from None
    except OSError as e:
        raise RunDirError(f"{path} could not be read ({e.strerror or e})") from None
    # not UTF-8, not JSON (or nested too deep), too large, a link: the message names the file and
    # what to do
    except ValueError as e:
        raise RunDirError(str(e)) from None


# metrics.jsonl grows with the run: a record per logged step, ~200 bytes each
METRICS_LIMIT = 256 << 20


def _read_run_text(path: Path, limit: int = RUN_FILE_LIMIT) -> str:
    """A run folder's text file (metrics.jsonl, samples.txt) read
    the one way (`files.read_text_safe`: no link, at most `limit`
    bytes), or a one-line RunDirError naming it; "" when absent."""
    try:
        return read_text_safe(path, limit)
    except FileNotFoundError:
        return ""
    except OSError as e:
        raise RunDirError(f"{path} could not be read ({e.strerror or e})") from None
    except ValueError as e:  # not UTF-8, too large, a link or FIFO: the message names the file
        raise RunDirError(str(e)) from None


def parse_jsonl(text: str, path: Path | str = METRICS) -> list[dict[str, Any]]:
    """The records of a JSON-lines text. A cut-off last line (a process killed mid-write) is
    dropped; a bad line anywhere else is an error naming the file and the line."""
    return [rec for _, rec in _numbered_records(text, path)]


def _numbered_records(text: str, path: Path | str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) of each record of a JSON-lines text (`parse_jsonl`)."""
    lines = [(i, ln) for i, ln in enumerate(text.split("\n"), 1) if ln.strip()]
    records = []
    for k, (i, line) in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError) as e:
            if k == len(lines):
                break
            why = "nests too deep" if isinstance(e, RecursionError) else f"is not JSON ({e})"
            raise RunDirError(f"{path} line {i} {why}; it holds one JSON object per line") from None
        if not isinstance(rec, dict):
            raise RunDirError(
                f"{path} line {i} is not a JSON object; it holds one JSON object per line"
            )
        records.append((i, rec))
    return records


# the largest step read back (STEP_DIGITS ASCII digits in a checkpoint's folder name)
MAX_STEP = 10**12 - 1
_METRICS_OBJECTS = ("startup",)  # the fields of a metrics record that are not numbers


def _metrics_problem(rec: dict[str, Any]) -> str | None:
    """What is wrong with one metrics.jsonl record (None when nothing is):
    its step must be a whole number from 0 to MAX_STEP, every other field
    a number or null (the start-up record's breakdown an object)."""
    step = rec.get("step")
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        return f"has step {str(step)[:40]!r}, not a whole number from 0 to {MAX_STEP:,}"
    for k, v in rec.items():
        if k in _METRICS_OBJECTS:
            if not isinstance(v, dict):
                return f"has {k!r} {str(v)[:40]!r}, not an object"
        elif k != "step" and v is not None and type(v) not in (int, float):
            return f"has {str(k)[:40]!r} {str(v)[:40]!r}, not a number"
    return None


@dataclass(frozen=True)
class RunDir:
    """The files of one run folder. `RunDir(path)` does no I/O."""

    path: Path

    def __init__(self, path: str | Path):
        object.__setattr__(self, "path", Path(path))

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    @property
    def name(self) -> str:
        return self.path.name

    # -- what it is
    def is_pretrain_run(self) -> bool:
        return (self.path / RUN_JSON).is_file()

    def is_finetune_run(self) -> bool:
        return (self.path / ADAPTER_CONFIG).is_file()

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def best(self) -> Path:
        return self.path / BEST

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS

    # -- one writer
    def check_held(self) -> None:
        """Before a write: when this process holds the folder's lock, the folder at the path must
        still be the one it locked (same device and inode). A folder deleted or recreated under a
        running writer (whose lock went with it, so another process may hold the new one) raises
        RunDirReplaced: the writer stops rather than mix its files into another run's. No-op where
        this process holds no lock on the path (readers; ranks other than 0)."""
        key = os.path.abspath(self.path)
        with _HELD_LOCK:
            held = _HELD.get(key)
        if held is None:
            return
        now = _identity(self.path)
        if now != held:
            what = "deleted"
            if now is not None:
                what = "deleted and made again (another folder now has its name)"
            raise RunDirReplaced(
                f"run folder {self.path} was {what} while this process was writing it, by another "
                "tab or process: this run stopped without writing into it. What it saved is gone "
                "from there (a --mirror keeps the checkpoints it copied); run the command again "
                "to start or resume there"
            )

    # -- run.json
    def recipe(self) -> Recipe:
        """run.json's recipe, every value checked (sizes,
        rates, ...) before anything is built from it."""
        d = self.recipe_dict()
        try:
            return Recipe.from_dict(d)
        except (ConfigError, KeyError, TypeError, ValueError) as e:
            raise RunDirError(
                f"{self.path / RUN_JSON} holds a recipe that cannot work ({e}); restore it from "
                "the mirror or start a new run folder"
            ) from None

    def info(self) -> dict[str, Any]:
        """run.json as a dict (a RunDirError when it is missing, garbage or not a run's)."""
        if not self.path.exists():
            raise RunDirError(missing_run_message(self.path))
        if not (self.path / RUN_JSON).is_file():
            raise RunDirError(
                f"{self.path} is not a tinygpt pretraining run folder (no {RUN_JSON}); train one "
                f"with `tinygpt pretrain {self.path}`"
            )
        info = read_json(self.path / RUN_JSON)
        if not isinstance(info, dict) or not isinstance(info.get("recipe"), dict):
            raise RunDirError(
                f"{self.path / RUN_JSON} does not hold a run's recipe; restore it from the mirror "
                "or start a new run folder"
            )
        return info

    def info_or_empty(self) -> dict[str, Any]:
        return self.info() if self.is_pretrain_run() else {}

    def recipe_dict(self) -> dict[str, Any]:
        return self.info()["recipe"]

    def write_info(self, info: dict[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path / RUN_JSON, info)

    def finetune_info(self) -> dict[str, Any] | None:
        """finetune.json (what a finetuning run was started with); None before the first start."""
        p = self.path / FINETUNE_JSON
        return read_json(p) if p.is_file() else None

    def adapter_info(self) -> dict[str, Any]:
        """tinygpt_finetune.json beside an adapter ({} when absent)."""
        p = self.path / ADAPTER_INFO
        return read_json(p) if p.is_file() else {}

    # -- metrics.jsonl
    def metrics(self) -> list[dict[str, Any]]:
        """The logged records; [] when nothing was logged yet."""
        p = self.metrics_path
        # bounded, never through a link
        records = _numbered_records(_read_run_text(p, METRICS_LIMIT), p)
        # checked here: a wrong type would fail far from the file, naming nothing
        for i, rec in records:
            if (why := _metrics_problem(rec)) is not None:
                raise RunDirError(
                    f"{p} line {i} {why}: it was not written by tinygpt; delete that line or "
                    "restore the file from a copy you trust"
                )
        return [rec for _, rec in records]

    def append_metrics(self, record: dict[str, Any]) -> None:
        self.check_held()  # only the lock holder appends: never into a folder that replaced its own
        append_text(self.metrics_path, json.dumps(record) + "\n")  # never through a link

    def keep_metrics_through(self, step: int) -> list[dict[str, Any]]:
        """Cut metrics.jsonl to the records up to `step` (a resumed run's log then equals an
        unbroken one); returns them. A cut-off line is dropped."""
        kept = [m for m in self.metrics() if m.get("step", 0) <= step]
        self.check_held()
        if self.metrics_path.exists():
            write_text_atomic(self.metrics_path, "".join(json.dumps(m) + "\n" for m in kept))
        return kept

    def recipe_name(self) -> str | None:
        """The recipe a run was started with: run.json's for pretraining, finetune.json's for
        finetuning; None when neither is readable."""
        for name in (RUN_JSON, FINETUNE_JSON):
            try:
                return str(read_json(self.path / name)["recipe"]["name"])
            except (RunDirError, TypeError, KeyError):
                continue
        return None

    # -- samples.txt
    def samples(self) -> str:
        return _read_run_text(self.path / SAMPLES)  # bounded, never through a link; "" when absent

    def append_sample(self, step: int, text: str) -> None:
        """One sample, under its step's heading."""
        self.check_held()
        self.path.mkdir(parents=True, exist_ok=True)
        # never through a link
        append_text(self.path / SAMPLES, f"{SAMPLE_HEADING.format(step=step)}\n{text}\n\n")

    def keep_samples_through(self, step: int) -> None:
        """Cut samples.txt to the samples of steps up to `step`, as metrics.jsonl
        is cut: a resumed run writes the later ones again (the same text: same
        weights and seed), so the file reads as an unbroken run's."""
        p = self.path / SAMPLES
        text = _read_run_text(p)  # bounded, never through a link
        later = next(
            (m.start() for m in _SAMPLE_HEADINGS.finditer(text) if int(m.group(1)) > step), None
        )
        if later is not None:
            self.check_held()
            write_text_atomic(p, text[:later])
