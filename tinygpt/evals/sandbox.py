"""Running code the model wrote, behind a kernel boundary.

`run(solution, test, ...)` runs a problem in two sandboxed processes (tinygpt/evals/sandbox_init.py,
the supervisor, and its siblings sandbox_child.py, sandbox_jail.py and sandbox_seccomp.py have the
inside): the solution (the prompt and the model's completion) in one, the test (the
prompt's helpers, the test code, `check(candidate)` or MBPP's asserts) in another, the candidate
being a proxy whose calls cross a pipe as plain values. The verdict is the test process's exit
status as its parent sees it plus a message on a pipe that only the test process holds, so nothing
the model's code does in its own process (`os._exit(0)`, ctypes, writing any descriptor) can turn
a failing test into a pass. `run(program)` runs one program alone (its verdict is that program's
own: it exited 0 after its last line).

The boundary is chosen at run time, the strongest the machine allows (`boundary()` probes it once
by running a program through it; `TINYGPT_SANDBOX=root|userns|uid|none` restricts the choice):

- ``root`` (root, as in Colab, with util-linux `unshare`): new PID, mount, network, IPC and UTS
  namespaces; inside, a tmpfs of `max_write_mb` becomes `/` with `/usr` and the Python install bound
  read-only and five device files (so /root, /home, /content, /etc, /tmp and the run folders do
  not exist in there) and is the only writable place, so the total written is capped; each process
  runs under its own unprivileged uid/gid with no supplementary groups, no-new-privs, no network,
  rlimits on address space, CPU time, file size, open files and processes, and a system call
  filter (seccomp, an allowlist: a call it does not name answers ENOSYS): no new process (the
  default; threads are allowed, up to 32), no SysV IPC, POSIX message queue or memfd (memory
  outside the address-space limit), no new namespace (a user namespace would give back every
  capability); the IPC namespace is checked to be its own and allows no SysV object. PID 1 of the
  namespace is the supervisor: when it ends, the kernel
  kills everything else in it, so nothing outlives a program.
- ``userns`` (no root, unprivileged user namespaces): the same, but the two processes share the
  caller's uid, with every capability dropped and the test process non-dumpable (started before
  the solution's), so the solution's process cannot ptrace it, read its memory or open its pipes.
  No user namespace can be made below the jail's (the filter, and max_user_namespaces 0 in it).
  Run by root, RLIMIT_NPROC does not count (the kernel exempts uid 0): threads are bounded by
  the address space only, and new processes by the filter.
- ``uid`` (root where namespaces cannot be made): each process under its own unprivileged uid
  with no supplementary groups, no-new-privs, the rlimits and the filter (no new process, no
  SysV IPC: the host's namespace is never reached), in a 0700 folder of its own; at the end
  every process of those uids is killed. Weaker: world-readable files are visible,
  world-writable folders (/tmp, /dev/shm) writable and what is written there stays, and only
  each file's size is capped.
- ``none``: no kernel boundary. `run` refuses unless `unsafe=True` (`tinygpt eval --unsafe-exec`),
  then runs both processes with the rlimits and the filter only, in a /tmp/tinygpt-exec-* folder
  removed after.

The filter is written for x86_64 and aarch64; elsewhere there is none: RLIMIT_NPROC alone refuses
new processes (and threads with them), SysV IPC is refused only in the namespace modes (by its
limits in the sandbox's IPC namespace), a nested user namespace only in the userns mode, and memfd
is bounded only by the timeout.

A caller interrupted (SIGTERM or Ctrl-C raised as KeyboardInterrupt) kills every sandbox still
running (`stop_all`); a caller killed outright takes them with it (the parent-death signal of
`setpriv --pdeathsig`, then `unshare --kill-child` ends the namespace).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import marshal
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

INIT = Path(__file__).with_name("sandbox_init.py")
KINDS = ("root", "userns", "uid", "none")
_UID_BASE = 1_200_000_000  # far above any uid a system or its users own
_live: set[subprocess.Popen] = set()
_live_lock = threading.Lock()
_stopping = threading.Event()  # set by stop_all: a sandbox starting meanwhile is killed at once


class SandboxUnavailable(RuntimeError):
    """No kernel boundary on this machine and unsafe execution was not asked for."""


@dataclass
class ExecResult:
    """status: passed, failed (an exception or a non-zero exit), timeout (wall clock), cpu_limit,
    out_of_memory, output_limit (wrote more than max_output_mb to a file or its output),
    exited_early (exit status 0 before the end of the tests, or the solution's process exiting
    before it was called), killed (another signal). boundary: the kind of sandbox it ran in."""

    status: str
    returncode: int | None
    duration_s: float
    stdout: str = ""
    stderr: str = ""
    boundary: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


class Limits(NamedTuple):
    """What one sandboxed program may use (`run`'s keywords of the same names)."""

    timeout_s: float
    memory_mb: int
    cpu_s: int
    max_output_mb: int
    max_write_mb: int
    max_processes: int


# the probe that finds a boundary: a small program under small limits
_PROBE = "import os\nprint(os.getuid(), os.listdir('/'))\n"
_PROBE_LIMITS = Limits(
    timeout_s=20, memory_mb=512, cpu_s=10, max_output_mb=1, max_write_mb=4, max_processes=1
)


@dataclass(frozen=True)
class Boundary:
    kind: str  # root | userns | uid | none
    prefix: tuple[str, ...]
    why_not: str = ""  # for none: what was tried and why it failed

    def describe(self) -> str:
        own = (
            "own PID, mount and network namespaces, a size-capped tmpfs as the only writable folder"
        )
        return {
            "root": f"a kernel boundary as root: {own}, an unprivileged uid per process",
            "userns": f"a kernel boundary in a user namespace: {own}, no capabilities",
            "uid": "a kernel boundary as root without namespaces: an unprivileged uid per process, "
            "a private folder, no new processes; world-readable files are visible and only each "
            "file's size is capped",
            "none": "no kernel boundary (rlimits only)",
        }[self.kind]


def _python() -> str:
    """The interpreter the sandbox runs: $TINYGPT_SANDBOX_PYTHON (for a Python installed where other
    users cannot read it, as the uid boundary needs), else this one's real path (a venv's python is
    a link to it; with -S no venv is needed)."""
    return os.path.realpath(os.environ.get("TINYGPT_SANDBOX_PYTHON") or sys.executable)


def _read_only_paths() -> list[str]:
    """What the jail shows, read-only: the system's programs and libraries, the Python install."""
    prefixes = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}
    prefixes.add(str(Path(_python()).parent.parent))
    return ["/usr", "/bin", "/lib", "/lib64", "/lib32", "/libx32", *sorted(prefixes)]


def _prefix(kind: str) -> tuple[str, ...] | None:
    """The command line before the supervisor's (None: this kind needs a tool that is missing)."""
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    head = (setpriv, "--pdeathsig", "KILL") if setpriv else ()
    if kind in ("uid", "none"):
        return head
    if unshare is None:
        return None
    user = ("--user", "--map-root-user") if kind == "userns" else ()
    return (*head, unshare, *user, *"--pid --fork --kill-child --mount --net --ipc --uts".split())


def boundary(kind: str | None = None) -> Boundary:
    """The strongest boundary that works here (or `kind`, else $TINYGPT_SANDBOX, when given), probed
    once per process by running a program through it."""
    wanted = kind or os.environ.get("TINYGPT_SANDBOX") or None
    if wanted is not None and wanted not in KINDS:
        raise ValueError(f"TINYGPT_SANDBOX={wanted!r}: choose one of {', '.join(KINDS)}")
    return _probe(wanted, _python())


@functools.lru_cache(maxsize=None)
def _probe(wanted: str | None, python: str) -> Boundary:
    tried = []
    for k in ("root", "userns", "uid"):
        if wanted not in (None, k):
            continue
        if k in ("root", "uid") and os.geteuid() != 0:
            tried.append(f"{k}: not root")
            continue
        prefix = _prefix(k)
        if prefix is None:
            tried.append(f"{k}: no util-linux `unshare`")
            continue
        b = Boundary(k, prefix)
        try:
            r = _run(b, None, _PROBE, "", None, False, _PROBE_LIMITS)
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            tried.append(f"{k}: {e}")
            continue
        jailed = "'usr'" in r.stdout or k == "uid"  # the jail's / lists usr (and little else)
        # root modes: not uid 0
        if r.passed and jailed and (k == "userns" or not r.stdout.startswith("0 ")):
            return b
        tried.append(f"{k}: {(r.stderr.strip().splitlines() or [r.status])[-1]}")
    why = "; ".join(tried) or f"TINYGPT_SANDBOX={wanted}"
    return Boundary("none", _prefix("none") or (), why)


def stop_all() -> None:
    """Kill every sandbox this process has running (and, through the namespace, all it started), and
    any that starts before `resume()`."""
    with _live_lock:
        _stopping.set()
        procs = list(_live)
    for p in procs:
        with contextlib.suppress(OSError):
            os.killpg(p.pid, signal.SIGKILL)


def resume() -> None:
    """Allow sandboxes again after `stop_all` (a new evaluation in the same process)."""
    _stopping.clear()


def _namespaces() -> dict[str, tuple[int, int] | None]:
    """This process's IPC and user namespaces (device, inode; None where /proc cannot tell): the
    supervisor checks that its own are others before it changes their limits."""
    out: dict[str, tuple[int, int] | None] = {}
    for name in ("ipc", "user"):
        try:
            st = os.stat(f"/proc/self/ns/{name}")
            out[name] = (st.st_dev, st.st_ino)
        except OSError:
            out[name] = None
    return out


def _supervise(b: Boundary, job: dict, timeout_s: float) -> tuple[subprocess.Popen, bytes, bytes]:
    """The supervisor process started behind boundary `b` with `job`, waited for (at most
    `timeout_s` + 30 s), its whole process group killed after, and its private folder removed."""
    folder = tempfile.mkdtemp(prefix="tinygpt-exec-") if b.kind in ("uid", "none") else None
    try:
        proc = subprocess.Popen(
            [*b.prefix, _python(), "-I", "-S", str(INIT), "supervise"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=folder or "/",
            env={"PATH": os.defpath, "LANG": "C.UTF-8"},
            start_new_session=True,
        )
        with _live_lock:
            _live.add(proc)
            if _stopping.is_set():
                os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, err = proc.communicate(marshal.dumps(job), timeout=timeout_s + 30)
        finally:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            with _live_lock:
                _live.discard(proc)
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    return proc, out, err


def _run(
    b: Boundary,
    solution: str | None,
    test: str,
    context: str,
    names: Sequence[str] | None,
    handles: bool,
    limits: Limits,
) -> ExecResult:
    """`solution` and `test` behind `b` under `limits`, its verdict parsed."""
    # distinct from any other sandbox's, in this process or another
    slot = secrets.randbelow(500_000_000)
    job = {
        "mode": b.kind,
        "solution": solution,
        "test": test,
        "context": context,
        "names": None if names is None else list(names),
        "handles": handles,
        "python": _python(),
        "read_only": _read_only_paths(),
        "timeout_s": limits.timeout_s,
        "memory_bytes": limits.memory_mb * 2**20,
        "cpu_s": limits.cpu_s,
        "max_output_bytes": limits.max_output_mb * 2**20,
        "max_write_bytes": limits.max_write_mb * 2**20,
        "max_processes": limits.max_processes,
        "uids": [_UID_BASE + 2 * slot, _UID_BASE + 2 * slot + 1],
        "caller_ns": _namespaces(),
    }
    t0 = time.monotonic()
    proc, out, err = _supervise(b, job, limits.timeout_s)
    duration = time.monotonic() - t0
    try:  # the supervisor's plain dict
        res = ast.literal_eval(out.decode("utf-8", "surrogateescape"))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        lines = err.decode("utf-8", "replace").strip().splitlines()
        why = lines[-1] if lines else f"supervisor exited {proc.returncode}"
        return ExecResult("failed", proc.returncode, duration, "", f"sandbox: {why}", b.kind)
    return ExecResult(
        res["status"], res["returncode"], duration, res["stdout"], res["stderr"], b.kind
    )


def run(
    program: str,
    test: str | None = None,
    *,
    context: str = "",
    names: Sequence[str] | None = None,
    handles: bool = True,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    cpu_s: int | None = None,
    max_output_mb: int = 16,
    max_write_mb: int = 64,
    max_processes: int = 1,
    unsafe: bool = False,
) -> ExecResult:
    """Run `program` (the solution) and, when given, `test` against it in a second process.

    With `test`: the test process runs `context` (e.g. HumanEval's prompt, for its helpers), then
    binds the solution's names (`names`: only these, e.g. the entry point; None: every top-level
    name the solution defines, as MBPP's asserts need) to proxies, then runs `test`; `handles=False`
    refuses any answer that is not a plain value. Without `test`, `program` runs alone. Limits: wall
    clock `timeout_s`; per process address space `memory_mb`, CPU `cpu_s` (default the timeout + 1
    s), `max_output_mb` per file or output stream, `max_processes` (1: none started; threads are
    allowed, 32 beyond it, where the system call filter is); `max_write_mb` in all (the jail's
    tmpfs; with no boundary only the per-file cap holds)."""
    if timeout_s <= 0 or memory_mb <= 0 or max_write_mb <= 0 or max_processes < 1:
        raise ValueError(
            "timeout_s, memory_mb and max_write_mb must be positive, max_processes at least 1"
        )
    b = boundary()
    if b.kind == "none" and not unsafe:
        raise SandboxUnavailable(unavailable_message(b))
    cpu_s = cpu_s if cpu_s is not None else int(timeout_s) + 1
    limits = Limits(timeout_s, memory_mb, cpu_s, max_output_mb, max_write_mb, max_processes)
    if test is None:
        return _run(b, None, program, "", None, handles, limits)
    return _run(b, program, test, context, names, handles, limits)


def unavailable_message(b: Boundary | None = None) -> str:
    b = b or boundary()
    return (
        f"no kernel boundary to run generated code behind on this machine ({b.why_not}); run as "
        "root or where user namespaces are allowed (Colab does both), or pass --unsafe-exec to "
        "run it with rlimits only, in a throwaway VM"
    )


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM raises KeyboardInterrupt for the duration (in the main thread; elsewhere a no-op), so
    that `tinygpt eval` killed by SIGTERM cleans up as after Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
