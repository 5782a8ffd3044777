"""The compiler's cache kept in the run folder, so a new VM on the same GPU skips most of the compile.

After the first compiled step the trainer saves `torch.compiler.save_cache_artifacts()` to
``run_dir/compile_cache.bin`` (mirrored to Drive with the run's files); a resumed run loads it before
its first step. The artifacts hold generated code that runs, so the file is signed (HMAC-SHA256)
with a key of this user's (kept in the tinygpt cache folder and beside the Drive mirror): a file
from anyone else's run folder is ignored, never loaded. A cache for another GPU, torch version or
model shape is ignored with a one-line note.

File layout: one JSON line (what the cache is for, and the signature), then the artifact bytes.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import platform
import secrets
from pathlib import Path

import torch

from tinygpt.core.files import write_bytes_atomic
from tinygpt.core.paths import cache_root
from tinygpt.core.rundir import COMPILE_CACHE

KEY_FILE = "compile-signing.key"


def signing_key(mirror_root: Path | None = None) -> bytes:
    """This user's key: the local one, else the mirror's (a new VM), else a new one; kept in both."""
    local = cache_root() / KEY_FILE
    remote = mirror_root / f".tinygpt-{KEY_FILE}" if mirror_root is not None else None
    key = None
    for p in (local, remote):
        try:
            if p is not None and p.is_file() and len(p.read_bytes()) == 32:
                key = p.read_bytes()
                break
        except OSError:
            pass  # an unreachable Drive: the local key or a new one
    key = key or secrets.token_bytes(32)
    for p in (local, remote):
        try:
            if p is not None and not p.is_file():
                p.parent.mkdir(parents=True, exist_ok=True)
                write_bytes_atomic(p, key)
                os.chmod(p, 0o600)
        except OSError:
            pass
    return key


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    return f"{device.type}-{platform.machine()}"


def describe(model: torch.nn.Module, device: torch.device, precision: str, micro_batch: int, seq_len: int,
             mode: str) -> dict:
    """What a compiled graph depends on: the cache is reused only when all of it is the same."""
    shapes = hashlib.sha256(repr([(n, tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()])
                            .encode()).hexdigest()[:16]
    return {"torch": torch.__version__, "device": device_name(device), "precision": precision,
            "batch": [micro_batch, seq_len], "model": shapes, "mode": mode}


class CompileCache:
    """Load before the first step, save after it. Never raises: a cache is only a cache."""

    def __init__(self, run_dir: Path, key: bytes, what: dict):
        self.path, self.key, self.what = Path(run_dir) / COMPILE_CACHE, key, what

    def _sign(self, payload: bytes) -> str:
        return hmac.new(self.key, json.dumps(self.what, sort_keys=True).encode() + payload, "sha256").hexdigest()

    def load(self) -> str | None:
        """Load the artifacts if they are ours and for this setup; a one-line note of what happened."""
        if not self.path.is_file():
            return None
        try:
            head, _, payload = self.path.read_bytes().partition(b"\n")
            header = json.loads(head)
        except (OSError, ValueError):
            return f"{self.path.name} is unreadable: ignored, compiling from scratch"
        if header.get("what") != self.what:
            diff = ", ".join(f"{k} {header.get('what', {}).get(k)} vs {v}" for k, v in self.what.items()
                             if header.get("what", {}).get(k) != v)
            return f"the compile cache is for another setup ({diff}): ignored, compiling from scratch"
        if not hmac.compare_digest(str(header.get("hmac", "")), self._sign(payload)):
            return "the compile cache is not signed with this user's key (another person's run folder?): ignored"
        try:
            torch.compiler.load_cache_artifacts(payload)
        except Exception as e:
            return f"the compile cache could not be loaded ({type(e).__name__}): compiling from scratch"
        return f"compile cache loaded ({len(payload) / 1e6:.1f} MB)"

    def save(self) -> int:
        """Write this process's artifacts; their size in bytes (0 if there were none or it failed)."""
        try:
            out = torch.compiler.save_cache_artifacts()
            if not out or not out[0]:
                return 0
            payload = bytes(out[0])
            header = json.dumps({"what": self.what, "hmac": self._sign(payload)}).encode()
            write_bytes_atomic(self.path, header + b"\n" + payload)
            return len(payload)
        except Exception:
            return 0
