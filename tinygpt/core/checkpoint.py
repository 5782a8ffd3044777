"""Atomic save and verified load of checkpoints.

A checkpoint is a folder ``step_000500/`` holding ``model.safetensors`` (Hugging Face Llama names),
``state.pt`` (optimizer, scheduler, scaler, RNGs, sampler position, step) and ``manifest.json``
(size and sha256 of every file). It is written under a temporary name, every file fsynced, the
manifest last, then renamed into place: a folder with a valid manifest is complete by construction,
and a load that finds a missing file or a wrong checksum refuses it, so the previous one is used.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import struct
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tinygpt.core.files import (
    MANIFEST,
    UnsafePathError,
    atomic_output,
    clean_leftovers,
    fsync,
    link_problem,
    open_nofollow,
    read_json_safe,
    safe_name,
    sha256_file,
    write_json_atomic,
)
from tinygpt.core.options import option
from tinygpt.core.rundir import BEST, RunDir

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
FORMAT_VERSION = 1
_PREFIXES = ("_orig_mod.", "module.")  # torch.compile and DDP wrappers


class CheckpointError(RuntimeError):
    pass


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def clean_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keys without torch.compile's `_orig_mod.` or DDP's `module.` anywhere in them."""
    out = {}
    for k, v in sd.items():
        for p in _PREFIXES:
            k = k.replace(p, "")
        out[k] = v
    return out


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A state_dict ready for safetensors: clean keys, contiguous CPU tensors, a tied lm_head
    dropped (safetensors refuses shared storage; Hugging Face omits it the same way)."""
    sd = clean_state_dict(model.state_dict())
    emb, head = sd.get("model.embed_tokens.weight"), sd.get("lm_head.weight")
    if emb is not None and head is not None and emb.data_ptr() == head.data_ptr():
        del sd["lm_head.weight"]
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}


def load_model_state(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Load a state saved by `model_state` (strict, except the tied lm_head)."""
    target = model
    while hasattr(target, "_orig_mod") or hasattr(target, "module"):
        target = getattr(target, "_orig_mod", None) or target.module
    missing, unexpected = target.load_state_dict(clean_state_dict(sd), strict=False)
    tied = getattr(getattr(target, "config", None), "tie_embeddings", False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def write_manifest(folder: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Hash every file in `folder` and write manifest.json (last, fsynced)."""
    files = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and not p.is_symlink() and p.name != MANIFEST:
            files[p.name] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    manifest = {"format": FORMAT_VERSION, "created_at": time.time(), **meta, "files": files}
    write_json_atomic(folder / MANIFEST, manifest)
    return manifest


def save_checkpoint(
    path: str | Path,
    model_sd: dict[str, torch.Tensor],
    train_state: dict[str, Any],
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write a complete checkpoint folder at `path` atomically (replacing one already there)."""
    from safetensors.torch import save_file

    path = Path(path)
    with atomic_output(path, folder=True) as tmp:
        save_file(model_sd, str(tmp / MODEL_FILE), metadata={"format": "pt"})
        torch.save(train_state, tmp / STATE_FILE)
        for p in tmp.iterdir():
            fsync(p)
        write_manifest(tmp, {"step": int(train_state.get("step", 0)), **(meta or {})})
    return path


def verify_checkpoint(
    path: str | Path, deep: bool = True, required: str = MODEL_FILE
) -> tuple[bool, str]:
    """(ok, reason). Checks the manifest (which must list `required`), each file's size, and (deep)
    each file's sha256 and each safetensors file's header (`check_safetensors`). Adapter folders are
    verified the same way (required: the adapter weights). Every name the manifest lists must be a
    plain file name (never a path that leaves the folder) of a plain file (never a link), and a
    `step_N` folder's manifest must say step N."""
    path = Path(path)
    mf = path / MANIFEST
    for p in (path, mf):
        if (why := link_problem(p)) is not None:
            return False, f"{why}, never followed"
    if not mf.is_file():
        return False, "no manifest.json (incomplete write)"
    try:
        manifest = read_manifest(path)
        files = manifest["files"]
        if not isinstance(files, dict) or not all(isinstance(i, dict) for i in files.values()):
            raise TypeError("'files' is not a table of files")
        for name in files:
            safe_name(name, mf, plain=True)
    except (UnsafePathError, CheckpointError) as e:  # each names the file itself
        return False, str(e)
    except (ValueError, KeyError, TypeError, OSError) as e:
        return False, f"unreadable manifest: {e}"
    if required not in files:
        return False, f"manifest lists no {required}"
    if step_of(path) is not None and manifest.get("step") != step_of(path):
        return False, f"its manifest says step {manifest.get('step')!r}, the folder is {path.name}"
    for name, info in files.items():
        p = path / name
        if (why := link_problem(p)) is not None:
            return False, f"{why}, never followed"
        if not p.is_file():
            return False, f"{name} is missing"
        if p.stat().st_size != info.get("size"):
            return False, f"{name} has {p.stat().st_size} bytes, manifest says {info.get('size')}"
        if deep and sha256_file(p) != info.get("sha256"):
            return False, f"{name} fails its sha256 check"
        # whoever writes a shared folder can write its manifest too
        if deep and name.endswith(".safetensors"):
            try:
                check_safetensors(p)
            except CheckpointError as e:
                return False, str(e)
    return True, "ok"


# the largest manifest.json read back (a real one lists three files: a few hundred bytes)
MANIFEST_LIMIT = 1 << 20


def read_manifest(path: str | Path) -> dict[str, Any]:
    """A checkpoint folder's manifest.json, read the one way a run file is read (no link, at most
    MANIFEST_LIMIT bytes); anything but a JSON object (or JSON nested too deep to parse) is a
    CheckpointError naming the file."""
    mf = Path(path) / MANIFEST
    try:
        manifest = read_json_safe(mf, MANIFEST_LIMIT)
    # not JSON (or nested too deep), too large, a link: read_json_safe's one line names the file
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(manifest, dict):
        raise CheckpointError(
            f"{mf} holds a JSON {type(manifest).__name__}, not a manifest: it was not written by "
            "tinygpt"
        )
    return manifest


STEP_DIGITS = 12  # a step number in a folder name or a samples.txt heading: 1 to 12 ASCII digits
_STEP_FOLDER = re.compile(rf"step_([0-9]{{1,{STEP_DIGITS}}})")


def step_of(folder: str | Path) -> int | None:
    """The step a checkpoint folder's name says (`step_000020`: 20); None for any other name,
    `step_` with anything but 1 to STEP_DIGITS ASCII digits among them (`step_²`, which
    `str.isdigit` takes for a digit and `int` refuses, or a 5000-digit number)."""
    m = _STEP_FOLDER.fullmatch(Path(folder).name)
    return int(m.group(1)) if m else None


def list_checkpoints(ckpt_root: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every `step_*` folder, oldest first (not verified). A symbolic link (the
    folder itself or a step folder) is never followed: it is left out with a warning."""
    root = Path(ckpt_root)
    out = []
    if (why := link_problem(root)) is not None:
        warnings.warn(f"{why}: not followed, its checkpoints are not used", stacklevel=2)
        return out
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith("step_") and step_of(p) is None:
                shown = (
                    p.name if len(p.name) <= 40 else p.name[:40] + f"... ({len(p.name)} characters)"
                )
                warnings.warn(
                    f"{root / shown} is not a checkpoint's name (step_ and 1 to {STEP_DIGITS} "
                    "ASCII digits): ignored; it was not written by tinygpt",
                    stacklevel=2,
                )
            if (step := step_of(p)) is not None:
                if p.is_symlink():
                    warnings.warn(
                        f"{link_problem(p)}: not followed, this checkpoint is not used",
                        stacklevel=2,
                    )
                elif p.is_dir():
                    out.append((step, p))
    return sorted(out)


def newest_complete(ckpt_root: str | Path) -> Path | None:
    """The newest checkpoint folder that passes the shallow check (manifest, sizes: each was hashed
    when written), or None."""
    ckpts = reversed(list_checkpoints(ckpt_root))
    return next((p for _, p in ckpts if verify_checkpoint(p, deep=False)[0]), None)


def latest_valid(ckpt_roots: list[str | Path] | str | Path) -> Path | None:
    """The newest checkpoint that verifies, across one or more `checkpoints/` folders; each one
    skipped is reported with a warning. Ties go to the first root (the local disk)."""
    roots = [ckpt_roots] if isinstance(ckpt_roots, (str, Path)) else list(ckpt_roots)
    candidates = []
    for rank, root in enumerate(roots):
        for step, p in list_checkpoints(root):
            candidates.append((step, -rank, p))
    for step, _, p in sorted(candidates, reverse=True):
        ok, why = verify_checkpoint(p)
        if ok:
            return p
        warnings.warn(f"skipping checkpoint {p}: {why}", stacklevel=2)
    return None


def load_checkpoint(
    path: str | Path, verify: bool = True, map_location="cpu", with_state: bool = True
) -> tuple[dict, dict, dict]:
    """(model state_dict, training state, manifest) of a verified checkpoint folder; the training
    state is {} when `with_state` is False (inference needs only the weights)."""
    path = Path(path)
    if verify:
        ok, why = verify_checkpoint(path)
        if not ok:
            raise CheckpointError(f"checkpoint {path} is not valid: {why}")
    sd = load_safetensors(path / MODEL_FILE)
    state = {}
    if with_state and (path / STATE_FILE).exists():
        state = _load_state(path / STATE_FILE, map_location)
    return sd, state, read_manifest(path)


# the largest safetensors header read (a 70B model's shard: well under 1 MB)
SAFETENSORS_HEADER_LIMIT = 64 << 20


def check_safetensors(path: str | Path) -> None:
    """Refuse a .safetensors file whose header is not one: its first 8 bytes (the header's length)
    over SAFETENSORS_HEADER_LIMIT or past the file's end, a header that is not a JSON object of
    tensors, or a tensor whose bytes lie outside the file. Read without following a link; every
    refusal is one CheckpointError naming the file, before the safetensors library reads it (whose
    errors name no file)."""
    path = Path(path)
    bad = None
    try:
        with open(open_nofollow(path, os.O_RDONLY), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if n is None:
                bad = f"holds {size} bytes, fewer than a safetensors header's 8"
            elif n > SAFETENSORS_HEADER_LIMIT:
                bad = (
                    f"says its header is {n:,} bytes, more than the "
                    f"{SAFETENSORS_HEADER_LIMIT:,} tinygpt reads"
                )
            elif 8 + n > size:
                bad = f"says its header is {n:,} bytes, past the file's end ({size:,} bytes)"
            else:
                header = json.loads(f.read(n).decode("utf-8"))
                bad = _header_problem(header, size - 8 - n)
    except (UnicodeDecodeError, ValueError, RecursionError):  # bad JSON
        bad = "has a header that is not JSON"
    except OSError as e:
        raise CheckpointError(f"{path} could not be read ({e.strerror or e})") from None
    if bad:
        raise CheckpointError(
            f"{path} is not a safetensors file: it {bad}; it was not written by tinygpt (or was "
            "cut short): delete the checkpoint folder or restore it from a copy you trust"
        )


def _header_problem(header: Any, data_bytes: int) -> str | None:
    if not isinstance(header, dict):
        return f"has a header that is a JSON {type(header).__name__}, not a table of tensors"
    for name, t in header.items():
        if name == "__metadata__":
            continue
        offsets = t.get("data_offsets") if isinstance(t, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes
        ):
            return (
                f"has a tensor {name[:80]!r} whose bytes are not inside the file "
                f"({str(offsets)[:80]})"
            )
    return None


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors file, its header checked first (`check_safetensors`); any
    failure is one CheckpointError naming the file."""
    from safetensors.torch import load_file

    check_safetensors(path)
    try:
        return load_file(str(path))
    # SafetensorError, and what torch makes of a wrong dtype or shape: none names the file
    except Exception as e:
        raise CheckpointError(
            f"{path} could not be read as safetensors ({one_line_of(e)}); it was not written by "
            "tinygpt (or was cut short): delete the checkpoint folder or restore it from a copy "
            "you trust"
        ) from None


def one_line_of(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return (text[:300] + "...") if len(text) > 300 else text


def _load_state(path: Path, map_location) -> dict:
    """The training state, weights-only: tensors, numbers, strings,
    lists and dicts, never code. A run folder may come from anyone (a
    shared Drive folder), so nothing in it is unpickled as objects."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"{path} holds more than tensors and numbers and was not loaded (it could run code); "
            "it was not written by this version of tinygpt: delete the checkpoint folder or "
            "start a new run folder"
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:  # not a torch file, or cut short
        raise CheckpointError(
            f"{path} could not be read ({one_line_of(e)}); it was not written by tinygpt (or was "
            "cut short): delete the checkpoint folder or restore it from a copy you trust"
        ) from None


def prune(ckpt_root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` step folders, never the newest valid one; also removes
    leftovers of interrupted writes. Returns what was deleted."""
    root = Path(ckpt_root)
    removed = []
    clean_leftovers(root)
    ckpts = list_checkpoints(root)
    # The shallow check (manifest, sizes) is enough here: each folder
    # was hashed when it was written, and re-reading gigabytes of
    # checkpoint after every save would cost more than the save itself.
    newest_valid = next(
        (p for _, p in reversed(ckpts) if verify_checkpoint(p, deep=False)[0]), None
    )
    for _, p in ckpts[:-keep_last] if keep_last > 0 else ckpts:
        if p != newest_valid:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


@dataclass(kw_only=True)
class RunCheckpoint:
    """A run folder and which of its checkpoints (`find_run_checkpoint`): the first options of `tinygpt
    eval`, `export` and `push` (each field is an option: core/options.py)."""

    run_dir: str = option(flag="RUN_DIR", help="a run folder (pretraining or finetuning)")
    which: str = option("latest", help="latest, best, or a checkpoint folder")


def find_run_checkpoint(run_dir: str | Path, which: str = "latest") -> Path:
    """The checkpoint folder of a run: "latest" (newest valid step), "best", or a folder path."""
    run_dir = Path(run_dir)
    if which not in ("latest", BEST):  # the selector names the folder it picks
        p = Path(which)
        # relative to the run folder, unless it exists as given
        if not p.is_absolute() and not p.exists():
            p = run_dir / which
        ok, why = verify_checkpoint(p)
        if not ok:
            raise CheckpointError(f"checkpoint {p} is not valid: {why}")
        return p
    if which == BEST and verify_checkpoint(RunDir(run_dir).best)[0]:
        return RunDir(run_dir).best
    p = latest_valid(RunDir(run_dir).checkpoints)
    if p is None:
        raise CheckpointError(
            f"{run_dir} holds no valid checkpoint; train first with "
            f"`tinygpt pretrain --run-dir {run_dir}`"
        )
    return p
