"""The compiler's cache kept in the run folder (``compile_cache.bin``, mirrored with the run), so a
new VM on the same GPU skips most of the compile: saved after the first compiled step, loaded before
a resumed run's first. A cache for another GPU, torch version or model shape is ignored with a note.

Trust: the artifacts hold generated code that runs, and a mirror is a shared folder others may
write. So the file is signed (HMAC-SHA256) with a key only this user holds and that never lives on
the mirror (`signing_key`); a cache that does not verify is compiled afresh. Even a signed cache is
unpacked here first: every artifact's destination must lie inside torch's own cache folder, else
the whole cache is refused before anything is written.

File layout: one JSON line (what the cache is for, and the signature), then the artifact bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import platform
import secrets
import stat
from pathlib import Path

import torch

from tinygpt.core.files import read_bytes_safe, write_bytes_atomic
from tinygpt.core.paths import cache_root
from tinygpt.core.rundir import COMPILE_CACHE, COMPILE_CACHE_LIMIT

KEY_FILE = "compile-signing.key"
KEY_ENV = "TINYGPT_COMPILE_KEY"  # also the name of the Colab secret
NEW_VM_HINT = (
    f"to reuse a compile cache from Drive on a new VM, give the same key on each: set ${KEY_ENV} "
    f"or add a Colab secret {KEY_ENV} (any long random text)"
)


def _colab_secret() -> str | None:
    """Colab's secret TINYGPT_COMPILE_KEY (None outside Colab, or when absent or not granted)."""
    try:
        from google.colab import userdata  # type: ignore[import-not-found]

        return userdata.get(KEY_ENV) or None
    except Exception:  # not in Colab, no such secret, or access not granted to this notebook
        return None


def _new_key_file(path: Path) -> bytes | None:
    """A new key, written whole to a private temporary and then linked to `path`, so that no process
    ever reads a key file half written (two runs starting at once on a fresh machine); None when
    another process made its key first. A failed write leaves no file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_bytes(32)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        _write_private(tmp, key)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return None
        # a file system without hard links: made in place, alone (O_EXCL) though not whole at once
        except OSError:
            try:
                _write_private(path, key)
            except FileExistsError:
                return None
    finally:
        tmp.unlink(missing_ok=True)
    return key


def _write_private(path: Path, data: bytes) -> None:
    """`data` in a new private file (never through a link); removed again if the write fails."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def signing_key() -> tuple[bytes | None, str | None]:
    """(this user's key, a note): derived from $TINYGPT_COMPILE_KEY or Colab's secret of that name,
    else read from (or first made in) the local key file; never from a mirror. (None, why) when the
    local key file is not this user's alone: the cache is then neither loaded nor saved."""
    given = os.environ.get(KEY_ENV) or _colab_secret()
    if given:
        return hashlib.sha256(b"tinygpt-compile-cache\0" + given.encode()).digest(), None
    path = cache_root() / KEY_FILE
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        try:
            key = _new_key_file(path)
        except OSError as e:
            return None, f"the compile cache is off: no key file could be made at {path} ({e})"
        if key is not None:
            return key, None
        st = os.lstat(path)  # another process made it first: its key, checked as any other
    except OSError as e:
        return None, f"the compile cache is off: its key file {path} is unreadable ({e})"
    why = None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        why = "is not a plain file"
    elif hasattr(os, "getuid") and st.st_uid != os.getuid():
        why = f"belongs to another user (uid {st.st_uid})"
    elif st.st_mode & 0o022:
        why = f"may be written by others (mode {stat.filemode(st.st_mode)})"
    elif st.st_size != 32:
        why = f"holds {st.st_size} bytes, not 32"
    if why:
        return None, (
            f"the compile cache key file {path} {why}: refused, the compile cache is not used; "
            f"delete it (a new one is made) or set ${KEY_ENV}"
        )
    # outside run folders: the user's key file, checked above (plain, own, 0600)
    return path.read_bytes(), None


def _inside(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([path, root]) == root


def _destination(kind: str, key: str) -> str | None:
    """Where torch would write an artifact of `kind` with `key` (how each artifact class picks its
    path in torch 2.x); None for a kind not known here."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    if kind == "autotune":  # AutotuneCacheArtifact: the key is a path joined to the cache folder
        return os.path.join(cache_dir(), key)
    if kind == "inductor":
        from torch._inductor.codecache import FxGraphCache

        return FxGraphCache._get_tmp_dir_for_key(key)
    if kind == "aot_autograd":
        from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache

        return AOTAutogradCache._get_tmp_dir_for_key(key)
    if kind == "pgo":
        from torch._dynamo.pgo import PGOCacheArtifact, code_state_path

        return (
            code_state_path(PGOCacheArtifact._rewrite_cache_key_for_mega_cache(key)) or cache_dir()
        )
    if kind == "precompile":
        from torch._dynamo.package import DynamoCache

        return os.path.join(DynamoCache.path_prefix(), key)
    return None


def checked_artifacts(payload: bytes):
    """The artifacts of a cache, unpacked without writing anything; a ValueError naming the first
    whose destination leaves torch's cache folder (an absolute or `..` key), or an unknown kind."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from torch.compiler._cache import CacheArtifactManager

    artifacts = CacheArtifactManager.deserialize(payload)
    if not artifacts:
        raise ValueError("it holds no artifacts this torch can read")
    root = cache_dir()
    for kind, items in artifacts.items():
        for a in items:
            dest = _destination(kind, a.key)
            if dest is None:
                raise ValueError(f"it holds a {kind!r} artifact, a kind not checked here")
            if (
                "\0" in a.key
                or os.path.isabs(a.key)
                or ".." in a.key.replace("\\", "/").split("/")
                or not _inside(dest, root)
            ):
                raise ValueError(
                    f"its {kind} artifact {a.key[:80]!r} would be written outside torch's cache "
                    f"folder {root}"
                )
    return artifacts


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        sm = "".join(map(str, torch.cuda.get_device_capability(device)))
        return f"{torch.cuda.get_device_name(device)} sm{sm}"
    return f"{device.type}-{platform.machine()}"


def describe(
    model: torch.nn.Module,
    device: torch.device,
    precision: str,
    micro_batch: int,
    seq_len: int,
    mode: str,
) -> dict:
    """What a compiled graph depends on: the cache is reused only when all of it is the same."""
    params = [(n, tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()]
    shapes = hashlib.sha256(repr(params).encode()).hexdigest()[:16]
    return {
        "torch": torch.__version__,
        "device": device_name(device),
        "precision": precision,
        "batch": [micro_batch, seq_len],
        "model": shapes,
        "mode": mode,
    }


class CompileCache:
    """Load before the first step, save after it. Never raises: a cache is only a cache. Without a
    key (`signing_key` refused the key file) nothing is loaded or saved and `load` says why."""

    def __init__(self, run_dir: Path, key: bytes | None, what: dict, key_note: str | None = None):
        self.path, self.key = Path(run_dir) / COMPILE_CACHE, key
        self.what, self.key_note = what, key_note

    def _sign(self, payload: bytes) -> str:
        what = json.dumps(self.what, sort_keys=True).encode()
        return hmac.new(self.key, what + payload, "sha256").hexdigest()

    def load(self) -> str | None:
        """Load the artifacts if ours and for this setup; a one-line note of what happened."""
        if self.key is None:
            return self.key_note
        if not self.path.is_file() or self.path.is_symlink():
            return None
        try:
            head, _, payload = read_bytes_safe(self.path, COMPILE_CACHE_LIMIT).partition(b"\n")
            header = json.loads(head)
        except (OSError, ValueError):  # FileTooLarge and UnsafePathError are ValueErrors
            return f"{self.path.name} is unreadable: ignored, compiling from scratch"
        if header.get("what") != self.what:
            theirs = header.get("what", {})
            diff = ", ".join(
                f"{k} {theirs.get(k)} vs {v}" for k, v in self.what.items() if theirs.get(k) != v
            )
            return (
                f"the compile cache is for another setup ({diff}): ignored, compiling from scratch"
            )
        if not hmac.compare_digest(str(header.get("hmac", "")), self._sign(payload)):
            return (
                "the compile cache is not signed with this user's key (another VM's or another "
                f"person's): ignored, compiling from scratch; {NEW_VM_HINT}"
            )
        try:
            artifacts = checked_artifacts(payload)
        except ValueError as e:
            return (
                f"the compile cache is refused, nothing of it was written: {e}; compiling from "
                "scratch"
            )
        # a torch whose cache classes differ: no checked load, so none at all
        except Exception as e:
            return (
                f"the compile cache could not be checked ({type(e).__name__}: {e}): compiling "
                "from scratch"
            )
        try:
            from torch.compiler._cache import CacheArtifactManager

            CacheArtifactManager.populate_caches(artifacts)
        except Exception as e:
            return (
                f"the compile cache could not be loaded ({type(e).__name__}): compiling from "
                "scratch"
            )
        return f"compile cache loaded ({len(payload) / 1e6:.1f} MB)"

    def save(self) -> int:
        """Write this process's artifacts; their size in bytes (0: none, or it failed)."""
        if self.key is None:
            return 0
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
