"""The sandbox's supervisor (tinygpt/evals/sandbox.py starts it), standard library only: run as
``python -I -S sandbox_init.py supervise``, it never imports tinygpt. Reads one job (marshal) on
stdin, builds the jail (in namespace modes it is PID 1 of a new PID namespace and owns a private
mount namespace: a size-capped tmpfs becomes ``/``, with ``/usr``, the Python install and five
device files bound read-only, so nothing else of the machine exists in there; sandbox_jail.py),
starts the test process and the solution process (sandbox_child.py's source, under the rlimits and a
system call allowlist: no new process, SysV IPC, memfd or namespace, nothing it does not name;
sandbox_seccomp.py), waits, kills everything, and prints one result (a dict literal) on stdout. Its
stdout is the only channel to the caller, and no child holds it.

It is a script, never imported: with ``-I`` neither tinygpt nor this folder is on sys.path, so its
three siblings (standard library only) are found through the folder appended after the standard
library, whose modules none of them shadows. Everything is imported and read before the jail is
built: inside it this folder does not exist."""

from __future__ import annotations

import contextlib
import os
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))
import sandbox_child  # noqa: E402
from sandbox_child import LINK_BROKEN, RESULT_PASSED, RESULT_READY  # noqa: E402
from sandbox_jail import Jail, no_ipc_nor_user_namespaces  # noqa: E402
from sandbox_seccomp import THREADS, install_filter, seccomp_filter  # noqa: E402


def _limits(job: dict, libc, drop_capabilities, seccomp: bytes | None) -> None:
    """In the child after fork (after setgroups/setgid/setuid in root mode), before exec. With the
    system call filter (`seccomp`), RLIMIT_NPROC leaves room for THREADS threads (MALLOC_ARENA_MAX=1
    keeps each one's cost to its stack): the filter, not the rlimit, refuses the new processes."""
    import resource  # already imported by the supervisor: the child's uid may not read the stdlib

    def limit(which: int, soft: int, hard: int | None = None) -> None:
        cur = resource.getrlimit(which)[1]
        hard = soft if hard is None else hard
        if cur != resource.RLIM_INFINITY:
            soft, hard = min(soft, cur), min(hard, cur)
        resource.setrlimit(which, (soft, hard))

    limit(resource.RLIMIT_AS, job["memory_bytes"])
    # SIGXCPU first (SIGKILL would hide why)
    limit(resource.RLIMIT_CPU, job["cpu_s"], job["cpu_s"] + 1)
    limit(resource.RLIMIT_FSIZE, job["max_output_bytes"])
    limit(resource.RLIMIT_CORE, 0)
    limit(resource.RLIMIT_NOFILE, 64)
    limit(resource.RLIMIT_NPROC, job["max_processes"] + (THREADS if seccomp is not None else 0))
    if drop_capabilities is not None:
        drop_capabilities()
    if libc is not None:
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: no setuid binary or file capability helps
    if seccomp is not None:
        install_filter(libc, seccomp)


def _host_libc():
    """The C library outside a jail (uid and none modes), for prctl; None where ctypes fails."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True)
    except (ImportError, OSError):
        return None


def _tail(path: str, n: int = 2000) -> tuple[str, int]:
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(max(0, size - n))
        return f.read().decode("utf-8", "replace"), size


def _status(rc: int | None, err: str, flooded: bool) -> str:
    import signal

    if rc == -signal.SIGXCPU:
        return "cpu_limit"
    if flooded or rc == -signal.SIGXFSZ:
        return "output_limit"
    if rc is not None and rc < 0:
        return "killed"
    if "MemoryError" in err:
        return "out_of_memory"
    return "failed"


def _child_env(cwd: str, n_fds: int) -> dict[str, str]:
    """A child's whole environment: nothing of the caller's."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": cwd,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        # threads share the heap: a 64 MB arena each would leave room for few of them
        "MALLOC_ARENA_MAX": "1",
        "TINYGPT_SANDBOX_FDS": ",".join(str(3 + i) for i in range(n_fds)),
    }


def _wait(pid: int, timeout: float) -> int | None:
    """The exit status (negative: the signal) or None after `timeout` seconds."""
    import select
    import time

    deadline = time.monotonic() + timeout
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if pidfd is not None:
                select.select([pidfd], [], [], left)
            else:
                time.sleep(min(left, 0.005))
    finally:
        if pidfd is not None:
            os.close(pidfd)


def supervise() -> None:
    """The supervisor: read the job, build the jail and the folders, run the test process (and the
    solution's) within the time limit, kill everything of the sandbox, then print the verdict, its
    only output."""
    import marshal
    import resource  # noqa: F401  (for _limits in the children, which may not read the stdlib)
    import select  # noqa: F401  (these three before the jail is built: it may hide the stdlib)
    import signal
    import time  # noqa: F401

    job = marshal.loads(sys.stdin.buffer.read())  # from tinygpt itself, not from the sandbox
    source = open(sandbox_child.__file__, encoding="utf-8").read()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller stops us with SIGKILL
    run = _Sandbox(job, source)
    try:
        run.start_and_wait()
    finally:
        run.kill_all()
    sys.stdout.write(repr(run.verdict()))
    sys.stdout.flush()


def _prepare(job: dict) -> tuple[Jail | None, str, str, dict[str, int]]:
    """The jail (root and userns modes: built, this process its PID 1) and each role's folder, owned
    by the role's uid where it has one: (jail or None, the work folder, the output folder, uid by
    role)."""
    mode = job["mode"]  # root | userns | uid | none
    jail = None
    if mode != "none":
        jail = Jail()
        jail.libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE: no child can ptrace this supervisor
    if mode in ("root", "userns"):
        no_ipc_nor_user_namespaces(job)
        jail.build(job)
        work = "/work"
        os.mkdir(work, 0o755)
        out_dir = "/.out"
    else:  # a folder the caller made (0700), removed by it after
        work = os.getcwd()
        out_dir = os.path.join(work, ".out")
        os.mkdir(out_dir, 0o700)
        if mode == "uid":
            os.chmod(work, 0o711)  # each uid reaches its own folder, lists nothing
    roles = ["test"] + (["serve"] if job["solution"] is not None else [])
    uids = dict(zip(roles, job["uids"])) if mode in ("root", "uid") else {}
    for role in roles:
        os.mkdir(f"{work}/{role}", 0o700)
        if uids:
            os.chown(f"{work}/{role}", uids[role], uids[role])
    return jail, work, out_dir, uids


class _Sandbox:
    """The test process and, when there is a solution, the solution's (`serve`): their pipes (the
    result pipe, held by the test process and this one only; requests and answers between the two),
    their starts, the wait, the kill, and the verdict read from the result pipe, the exit codes and
    the output files."""

    def __init__(self, job: dict, source: str) -> None:
        import time

        self.job, self.source = job, source
        self.jail, self.work, self.out_dir, self.uids = _prepare(job)
        self.jailed = job["mode"] in ("root", "userns")
        self.two = job["solution"] is not None
        self.result_r, self.result_w = os.pipe()
        links = (*os.pipe(), *os.pipe()) if self.two else ()  # requests r/w, answers r/w
        self.links = links
        self.fds = {
            "test": [self.result_w, *((links[1], links[2]) if self.two else ())],
            "serve": [links[0], links[3]] if self.two else [],
        }
        self.pids: dict[str, int] = {}
        self.codes: dict[str, int | None] = {}
        self.deadline = time.monotonic() + job["timeout_s"]
        self.timed_out = False
        self.ready = b""

    def _spawn(self, role: str) -> tuple[int, int]:
        """fork + exec of a child: its job on a pipe as stdin, output to files, its descriptors
        as 3, 4, 5; in the child, before exec: its own session, setgroups([]) / setgid / setuid
        (root mode), the limits, no-new-privs. Returns (pid, the write end of its stdin). Plain os
        calls: no subprocess import."""
        import fcntl

        job, jail, uid, fds = self.job, self.jail, self.uids.get(role), self.fds[role]
        cwd = f"{self.work}/{role}"
        r, w = os.pipe()
        o = os.open(f"{self.out_dir}/{role}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        e = os.open(f"{self.out_dir}/{role}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        env = _child_env(cwd, len(fds))
        libc = jail.libc if jail is not None else _host_libc()
        seccomp = seccomp_filter(job["max_processes"] > 1) if libc is not None else None
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100) for fd in (r, o, e, *fds)]
                for target, fd in enumerate(high):
                    os.dup2(fd, target)  # inheritable
                os.closerange(len(high), 1 << 20)
                os.chdir(cwd)
                if uid is not None:
                    os.setgroups([])
                    os.setresgid(uid, uid, uid)
                    os.setresuid(uid, uid, uid)
                drop = jail.drop_capabilities if job["mode"] == "userns" else None
                _limits(job, libc, drop, seccomp)
                # Its own session keeps it out of the supervisor's process group, so when the caller
                # SIGKILLs the supervisor (Ctrl-C, SIGTERM) only this signal ends it where no PID
                # namespace does (uid, none)
                if libc is not None:
                    # PR_SET_PDEATHSIG: SIGKILL (set after setuid, which would clear it)
                    libc.prctl(1, 9, 0, 0, 0)
                # the supervisor died before that: nobody would ever stop this one
                if os.getppid() != parent:
                    os._exit(127)
                os.execve(job["python"], [job["python"], "-I", "-S", "-c", self.source, role], env)
            except BaseException as ex:  # noqa: BLE001 (a child never returns into the supervisor)
                os.write(2, f"sandbox: could not start the {role} process: {ex!r}\n".encode())
            os._exit(127)
        for fd in (r, o, e):
            os.close(fd)
        return pid, w

    def start(self, role: str, payload: dict) -> None:
        import marshal

        self.pids[role], stdin = self._spawn(role)
        with contextlib.suppress(OSError):
            data = marshal.dumps(payload)
            while data:
                data = data[os.write(stdin, data) :]
        os.close(stdin)

    def start_and_wait(self) -> None:
        """Start the test process; once it has made itself non-dumpable (READY on the result pipe),
        the solution's; then wait for the test process until the deadline."""
        import select
        import time

        job = self.job
        self.start("test", {"context": job["context"], "test": job["test"], "names": job["names"]})
        os.close(self.result_w)
        if self.two:
            # The test process makes itself non-dumpable first; only then does the solution's exist.
            left = max(0.0, self.deadline - time.monotonic())
            if select.select([self.result_r], [], [], left)[0]:
                self.ready = os.read(self.result_r, 1)
            if self.ready == RESULT_READY:
                self.start("serve", {"program": job["solution"], "handles": job["handles"]})
            for fd in self.links:
                os.close(fd)
        self.codes["test"] = _wait(self.pids["test"], max(0.0, self.deadline - time.monotonic()))
        self.timed_out = self.codes["test"] is None

    def kill_all(self) -> None:
        """Kill every process of the sandbox, wherever it went, and reap the children."""
        import signal

        for pid in self.pids.values():
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)  # the process and its group
        if self.jailed:
            with contextlib.suppress(OSError):
                os.kill(-1, signal.SIGKILL)  # as PID 1 of this namespace: everything else in it
        # no namespace: every process of the sandbox's uids, wherever it went
        for uid in self.uids.values():
            killer = os.fork()
            if killer == 0:
                try:
                    os.setresuid(uid, uid, uid)
                    os.kill(-1, signal.SIGKILL)  # as that uid: all its processes but this one
                except BaseException:  # noqa: BLE001
                    pass
                os._exit(0)
            os.waitpid(killer, 0)
        for role, pid in self.pids.items():
            if self.codes.get(role) is None:
                self.codes[role] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    def verdict(self) -> dict:
        """status (passed only when the test process wrote PASSED and exited 0), return code, the
        output tails."""
        os.set_blocking(self.result_r, False)
        try:
            said = self.ready + os.read(self.result_r, 16)
        except BlockingIOError:
            said = self.ready
        tails = {}
        for role in self.pids:
            o, o_size = _tail(f"{self.out_dir}/{role}.out")
            e, e_size = _tail(f"{self.out_dir}/{role}.err")
            tails[role] = (o, e, max(o_size, e_size) >= self.job["max_output_bytes"])
        test_rc = self.codes["test"]
        t_out, t_err, t_flood = tails["test"]
        if self.timed_out:
            status = "timeout"
        elif test_rc == 0:
            status = "passed" if RESULT_PASSED in said else "exited_early"
        elif test_rc == LINK_BROKEN and "serve" in self.pids:
            s_rc = self.codes["serve"]
            status = (
                "exited_early" if s_rc == 0 else _status(s_rc, tails["serve"][1], tails["serve"][2])
            )
        else:
            status = _status(test_rc, t_err, t_flood)
        if "serve" in tails:
            s_out, s_err, _ = tails["serve"]
            t_out = s_out + t_out
            t_err = t_err + (f"\n--- the solution's process ---\n{s_err}" if s_err.strip() else "")
        return {
            "status": status,
            "returncode": None if self.timed_out else test_rc,
            "stdout": t_out,
            "stderr": t_err,
        }


if __name__ == "__main__" and sys.argv[1:2] == ["supervise"]:
    supervise()
