"""The sandbox for generated code (tinygpt/evals/sandbox.py; issue 21 item 1, issue 22 item 6): each
attack that escaped the audit-hook sandbox of 0f7fccf, and its obvious variants, is run for real,
as the model's code (the solution process) and as the data file's code (the test process), in
every kernel boundary this machine offers; each asserts that no proof file appears outside the
sandbox, nothing of the user's was read, and the verdict is not "passed". Then the CLI path: a
crafted HumanEval file through `tinygpt eval` on a tiny trained run, the refusal without a
boundary, and SIGTERM / SIGINT mid-eval leaving no process and no folder."""

from __future__ import annotations

import ast
import contextlib
import gzip
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tinygpt.cli import main
from tinygpt.evals import code, sandbox, sandbox_seccomp
from tinygpt.evals.tasks.humaneval import load_humaneval
from tinygpt.evals.tasks.mbpp import load_mbpp
from tinygpt.pretrain.run_pretrain import pretrain

REPO = Path(__file__).resolve().parents[1]


# root in the fast tier; the other two boundaries run the same tests in the full suite (`-m slow`)
@pytest.fixture(
    params=[
        "root",
        pytest.param("userns", marks=pytest.mark.slow),
        pytest.param("uid", marks=pytest.mark.slow),
    ]
)
def kind(request, monkeypatch) -> str:
    """Each kernel boundary this machine offers (root: Colab's case; userns: a user's machine; uid:
    root where no namespace can be made)."""
    python = Path(os.path.realpath(sys.executable))
    if (
        request.param == "uid"
        and any(not p.stat().st_mode & 0o001 for p in python.parents)
        and Path("/usr/bin/python3").is_file()
    ):  # a Python in a private home (pyenv under /root)
        monkeypatch.setenv("TINYGPT_SANDBOX_PYTHON", "/usr/bin/python3")
    b = sandbox.boundary(request.param)
    if b.kind != request.param:
        pytest.skip(f"no {request.param} boundary here: {b.why_not}")
    monkeypatch.setenv("TINYGPT_SANDBOX", request.param)
    return request.param


@pytest.fixture
def victim(tmp_path) -> Path:
    """A file of the user's, outside the sandbox."""
    v = tmp_path / "users_file.txt"
    v.write_text("keep me")
    return v


def _attacks(proof: Path, victim: Path) -> dict[str, str]:
    """Programs that, in the sandbox of 0f7fccf, wrote `proof` (outside the sandbox) or read secrets."""
    rel = str(proof).lstrip("/")
    write_proof = f"open({str(proof)!r}, 'w').write('escaped')"
    attacks = {
        # the audit hook resolved paths against the cwd, the kernel against dir_fd
        "dir_fd": f"""import os
os.makedirs('a/b/c/d/e/f/g/h', exist_ok=True); os.chdir('a/b/c/d/e/f/g/h')
fd = os.open('.', os.O_RDONLY)
data = os.read(os.open('../' * 9 + 'etc/shadow', os.O_RDONLY, dir_fd=fd), 4096)
os.write(os.open('../' * 9 + {rel!r}, os.O_WRONLY | os.O_CREAT, dir_fd=fd), data)""",
        "fork_exec": f"import subprocess\nsubprocess.run(['/bin/sh', '-c', 'id > {proof}; cat /etc/shadow >> {proof}'])",
        "posix_spawn": f"import os\nos.posix_spawn('/bin/sh', ['sh', '-c', 'id > {proof}'], {{}})",
        "ctypes_dlsym": f"""import _ctypes
_ctypes.call_function(_ctypes.dlsym(_ctypes.dlopen(None), 'system'), (b'id > {proof}',))
assert open({str(proof)!r}).read()""",
        "ctypes_cdll": f"import ctypes\nassert ctypes.CDLL(None).system(b'touch {proof}') == 0",
        "os_fork": f"""import os
pid = os.fork()
if pid == 0:
    {write_proof}
    os._exit(0)
os.waitpid(pid, 0)""",
        "read_victim": f"print(open({str(victim)!r}).read())\n{write_proof}",
        "write_victim": f"open({str(victim)!r}, 'w').write('gone')",
        "hard_link": f"import os\nos.link({str(victim)!r}, 'mine')\nopen('mine', 'w').write('gone')",
        "symlinked_folder": f"import os\nos.symlink({str(proof.parent)!r}, 'out')\nopen('out/{proof.name}', 'w').write('x')",
        "proc_self_mem": "f = open('/proc/self/mem', 'r+b')\nprint(f)",
        "list_homes": f"import os\nprint(os.listdir('/root'), os.listdir('/home'), os.listdir('/content'))\n{write_proof}",
        "etc_shadow": f"print(open('/etc/shadow').read())\n{write_proof}",
    }
    # each ends by checking its own success, so that a blocked attack is a failing program too
    return {k: f"{a}\nimport os\nassert os.path.exists({str(proof)!r})" for k, a in attacks.items()}


def test_no_attack_escapes_from_the_solution_or_the_test(kind, tmp_path, victim):
    proof = tmp_path / "proof.txt"
    for name, attack in _attacks(proof, victim).items():
        # as the model's code: the function is defined after the attack, the test calls it
        r = sandbox.run(
            f"{attack}\ndef f():\n    return 1\n", "assert f() == 1\n", names=("f",), timeout_s=20
        )
        assert not r.passed and r.boundary == kind, (name, r.status, r.stderr[-500:])
        # as the data file's code (a HumanEval prompt or test carries it into the test process)
        r = sandbox.run(
            "def f():\n    return 1\n", f"{attack}\nassert f() == 1\n", names=("f",), timeout_s=20
        )
        assert not r.passed, (name, r.status, r.stderr[-500:])
        assert not proof.exists(), name
        assert victim.read_text() == "keep me", name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["users_file.txt"]


def test_the_sandbox_sees_no_user_files_and_writes_only_its_folder(kind, tmp_path, victim):
    if kind == "uid":
        pytest.skip("the jail's guarantee: the uid boundary (no namespaces) does not give it")
    seen = sandbox.run(
        f"""import json, os
def ls(p):
    try:
        return sorted(os.listdir(p))
    except OSError as e:
        return e.strerror
print(json.dumps({{'root': ls('/'), 'home': ls('/home'), 'content': ls('/content'), 'etc': ls('/etc'),
                   'tmp': ls('/tmp'), 'victim': os.path.exists({str(victim)!r}), 'repo': os.path.exists({str(REPO)!r}),
                   'uid': os.getuid(), 'groups': os.getgroups()}}))
open('scratch.txt', 'w').write('mine')
print(open('scratch.txt').read())
""",
        timeout_s=20,
    )
    assert seen.passed, seen.stderr
    info = json.loads(seen.stdout.splitlines()[0])
    py_top = Path(os.path.realpath(sys.executable)).parts[
        1
    ]  # the Python install is shown, read-only
    assert set(info["root"]) <= {
        "usr",
        "bin",
        "lib",
        "lib64",
        "lib32",
        "libx32",
        "dev",
        "tmp",
        "work",
        ".out",
        py_top,
    }
    assert info["tmp"] == [] and not info["victim"] and not info["repo"]
    assert info["home"] == info["content"] == info[
        "etc"
    ] == "No such file or directory" or py_top in ("home",)
    if kind == "root":  # an unprivileged uid with no supplementary group
        assert info["uid"] >= 1_000_000 and info["groups"] == []
    assert seen.stdout.splitlines()[1] == "mine"


def test_a_forged_pass_is_a_failure(kind):
    """The model's code cannot make a failing test pass: not by exiting 0, nor by writing the
    harness's marker on every descriptor it has, nor by answering with an object that equals all."""
    forgeries = {
        "exit_0": "import os\nos._exit(0)\n",
        "exit_in_call": "import os\ndef f():\n    os._exit(0)\n",
        "marker_everywhere": (
            "import os, sys\nsys.modules['__main__'].__dict__['passed'] = True\n"
            "for fd in range(64):\n    try:\n        os.write(fd, b'P' * 64)\n    except OSError:\n"
            "        pass\nos._exit(0)\n"
        ),
        "stop_everyone": (
            "import os, signal\nfor pid in set(range(1, 400)) - {os.getpid()}:\n    try:\n"
            "        os.kill(pid, signal.SIGSTOP)\n    except OSError:\n        pass\n"
            "def f():\n    return 1\n"
        ),
        "always_equal": "class A:\n    def __eq__(self, other):\n        return True\ndef f():\n    return A()\n",
    }
    for name, solution in forgeries.items():
        for handles in (
            False,
            True,
        ):  # HumanEval: plain values only; MBPP: handles to the solution's objects
            r = sandbox.run(
                solution,
                "assert f() == 2\nassert False\n"
                if name != "always_equal"
                else "assert f() == 2\n",
                names=None if handles else ("f",),
                handles=handles,
                timeout_s=5,
            )
            assert not r.passed, (name, handles, r.status, r.stderr[-300:])
    ok = sandbox.run("def f():\n    return 2\n", "assert f() == 2\n", names=("f",), handles=False)
    assert ok.passed, ok.stderr  # the same test passes an honest solution


def test_writes_are_capped_in_total_and_nothing_outlives_the_sandbox(kind):
    """120 files of 15 MB wrote 1.8 GB at 0f7fccf (only each file was capped); a `setsid sleep`
    child outlived it. Now the total is capped by the jail's tmpfs, and the PID namespace ends
    every process (here with processes allowed, to show the namespace does it)."""
    if kind == "uid":
        pytest.skip("the jail's guarantee: the uid boundary (no namespaces) does not give it")
    r = sandbox.run(
        """import os
total = 0
try:
    for i in range(120):
        with open(f'big{i}', 'wb') as f:
            for _ in range(15):
                f.write(b'x' * 2**20)
                f.flush()
                total += 2**20
except OSError as e:
    print(total, e.errno)
    raise
""",
        max_write_mb=8,
        max_output_mb=16,
        timeout_s=20,
    )
    written, errno_ = map(int, r.stdout.split())
    assert r.status == "failed" and written <= 8 * 2**20 and errno_ == 28, (
        r.status,
        r.stdout,
    )  # ENOSPC
    marker = f"{time.time_ns() % 10**6}.5"
    r = sandbox.run(
        f"""import os
pid = os.fork()
if pid == 0:
    os.setsid()
    os.execv('/bin/sleep', ['sleep', '{marker}'])
print(pid)
""",
        max_processes=8,
        timeout_s=20,
    )
    assert r.passed, r.stderr
    time.sleep(0.2)
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and marker in _cmdline(p)]
    assert not left, f"{len(left)} process(es) outlived the sandbox"
    r = sandbox.run("import os\nos.fork()\n", timeout_s=20)  # the default: no new process at all
    assert (
        r.status == "failed" and "PermissionError" in r.stderr
    )  # (the filter: also where RLIMIT_NPROC is not)


def test_no_network(kind):
    if kind == "uid":
        pytest.skip("the jail's guarantee: the uid boundary (no namespaces) does not give it")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        r = sandbox.run(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).send(b'hi')\n",
            timeout_s=20,
        )
        assert r.status == "failed" and "Error" in r.stderr
        with pytest.raises(socket.timeout):
            server.accept()


def _cmdline(p: Path) -> str:
    try:
        return (p / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def test_limits_and_statuses(kind):
    assert sandbox.run("while True:\n    pass\n", timeout_s=1).status == "timeout"
    assert sandbox.run("while True:\n    pass\n", timeout_s=30, cpu_s=1).status == "cpu_limit"
    assert sandbox.run("x = bytearray(4 * 1024**3)\n").status == "out_of_memory"
    assert (
        sandbox.run(
            "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", max_output_mb=1
        ).status
        == "output_limit"
    )
    assert (
        sandbox.run(
            "def f():\n    while True:\n        pass\n", "f()\n", names=None, timeout_s=30, cpu_s=1
        ).status
        == "cpu_limit"
    )  # the solution's process hit the limit
    assert sandbox.run("import os\nos._exit(0)\n", "f()\n", names=None).status == "exited_early"
    r = sandbox.run("import nothing_of_that_name\n", "f()\n", names=("f",))
    assert (
        r.status == "failed" and "ModuleNotFoundError" in r.stderr
    )  # the solution's traceback is shown
    r = sandbox.run(
        "def f(x):\n    raise KeyError(x)\n",
        "try:\n    f(3)\nexcept KeyError as e:\n    assert e.args == ('3',)\n",
        names=("f",),
    )
    assert r.passed, r.stderr  # built-in exceptions cross as themselves


# --- memory outside the limits, threads, namespaces (issue 32 item 9) -----------------------------


def _needs_filter() -> None:
    if sandbox_seccomp.seccomp_filter(False) is None:
        pytest.skip(f"no system call filter for {os.uname().machine} (x86_64 and aarch64 only)")


def _host_shm_owners() -> set[int]:
    """The uids owning SysV shared memory segments in the host's IPC namespace."""
    try:
        rows = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    except OSError:
        return set()
    return {int(r.split()[7]) for r in rows if len(r.split()) > 7}


def test_sysv_ipc_and_memfd_hold_no_memory_past_the_limits(kind):
    """SysV shared memory held 3.0 GB past a 1 GB RLIMIT_AS, and memfd 944 MB more, until the timeout
    (at ee92b4d); in the uid mode the segments were the host's and stayed after the sandbox ended. Each
    here holds twice the address-space limit where it is allowed: now every way in is refused."""
    _needs_filter()
    limit, chunk = 64, 8  # MB; max_output_mb (each file's cap, memfd's too) is the chunk
    shm = f"""import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
for i in range({2 * limit // chunk}):
    sid = libc.shmget(0, {chunk} * 2**20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600; never removed
    if sid < 0:
        raise OSError(ctypes.get_errno(), 'shmget')
    p = libc.shmat(sid, None, 0)
    ctypes.memset(p, 1, {chunk} * 2**20)
    libc.shmdt(ctypes.c_void_p(p))
print('held', {2 * limit}, 'MB')
"""
    memfd = f"""import os
fds = [os.memfd_create('x') for _ in range({2 * limit // chunk})]
for fd in fds:
    for _ in range({chunk}):
        os.write(fd, b'x' * 2**20)
print('held', {2 * limit}, 'MB')
"""
    others = {  # the other IPC kinds: a message queue, a semaphore set (held past the sandbox in the uid mode)
        "msgget": "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nif libc.msgget(0, 0o1600) < 0:\n"
        "    raise OSError(ctypes.get_errno(), 'msgget')\n",
        "semget": "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nif libc.semget(0, 1, 0o1600) < 0:\n"
        "    raise OSError(ctypes.get_errno(), 'semget')\n",
    }
    before = _host_shm_owners()
    for name, program in {"shm": shm, "memfd": memfd, **others}.items():
        r = sandbox.run(program, memory_mb=limit, max_output_mb=chunk, timeout_s=30)
        assert r.status == "failed" and "PermissionError: [Errno 1]" in r.stderr, (
            name,
            r.status,
            r.stdout,
            r.stderr[-300:],
        )
        assert "held" not in r.stdout
    assert not {
        u for u in _host_shm_owners() - before if u >= 1_000_000
    }  # nothing of the sandbox's on the host
    if kind == "uid":
        return  # no namespace: the filter alone keeps the host's IPC out of reach
    results: list = []  # the namespace modes: the running program's IPC namespace is not this one's
    box = threading.Thread(
        target=lambda: results.append(sandbox.run("import time\ntime.sleep(3)\n", timeout_s=20))
    )
    box.start()
    # the program's namespace as last seen while it runs (the newest process with " -c " in its command line): a
    # launcher is seen in this namespace for the moment before it unshares, so a first sighting cannot tell them apart
    deadline, theirs = time.monotonic() + 15, None
    while box.is_alive() and time.monotonic() < deadline:
        launched = [
            pid for pid in _descendants(os.getpid()) if " -c " in _cmdline(Path(f"/proc/{pid}"))
        ]
        if launched:
            with contextlib.suppress(OSError):
                theirs = os.stat(f"/proc/{max(launched)}/ns/ipc").st_ino
        time.sleep(0.05)
    box.join()
    assert (
        results[0].passed and theirs is not None and theirs != os.stat("/proc/self/ns/ipc").st_ino
    )


THREADED_SOLUTION = """import threading
from concurrent.futures import ThreadPoolExecutor


def total(xs):
    out = []
    t = threading.Thread(target=lambda: out.append(sum(xs)))
    t.start()
    t.join()
    with ThreadPoolExecutor(8) as pool:
        squares = list(pool.map(lambda x: x * x, xs))
    return out[0] + sum(squares)
"""


def test_a_threaded_solution_passes_and_new_processes_stay_refused(kind):
    """A correct solution that starts a thread scored `failed` at ee92b4d ("can't start new thread":
    RLIMIT_NPROC 1). Now threads run (a pool of 8, in the solution and in the test), while every way
    to a new process is still refused (and a user namespace run by root, which RLIMIT_NPROC does not
    bind, refuses them too); a thread bomb ends at the allowance or the address space."""
    _needs_filter()
    r = sandbox.run(
        THREADED_SOLUTION,
        "assert total([1, 2, 3]) == 6 + 14\n",
        names=("total",),
        handles=False,
        timeout_s=30,
    )
    assert r.passed, (r.status, r.stderr[-500:])
    r = sandbox.run(
        "def f():\n    return 1\n",
        THREADED_SOLUTION + "assert total([f(), 2]) == 3 + 5\n",
        names=("f",),
        timeout_s=30,
    )
    assert r.passed, (r.status, r.stderr[-500:])
    clone = {"x86_64": 56, "aarch64": 220}.get(os.uname().machine, -1)
    starts = {
        "fork": "import os\nif os.fork() == 0:\n    os._exit(0)\n",
        "subprocess": "import subprocess\nsubprocess.run(['/bin/true'])\n",
        "posix_spawn": "import os\nos.posix_spawn('/bin/true', ['true'], {})\n",
        "raw_clone": f"""import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
pid = libc.syscall({clone}, 17, 0, 0, 0, 0)  # clone(SIGCHLD): a fork by hand
if pid == 0:
    os._exit(0)
if pid < 0:
    raise OSError(ctypes.get_errno(), 'clone')
""",
    }
    for name, program in starts.items():
        r = sandbox.run(program, timeout_s=20)
        assert r.status == "failed" and "PermissionError" in r.stderr, (
            name,
            r.status,
            r.stderr[-300:],
        )
    bomb = "import threading, time\nfor _ in range(1000):\n    threading.Thread(target=time.sleep, args=(5,)).start()\n"
    r = sandbox.run(bomb, timeout_s=30)
    assert r.status == "failed" and "can't start new thread" in r.stderr, (
        r.status,
        r.stderr[-300:],
    )


def test_no_user_namespace_inside_the_jail(kind):
    """At ee92b4d the model's code could make a user namespace (every capability inside it, a tmpfs of
    any size among them), or join another: now unshare, setns and clone with CLONE_NEWUSER fail with
    EPERM, also where new processes are allowed."""
    _needs_filter()
    clone = {"x86_64": 56, "aarch64": 220}.get(os.uname().machine, -1)
    program = f"""import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
errors = {{}}
for name, call in {{
        'unshare_user': lambda: libc.unshare(0x10000000),
        'unshare_user_mount': lambda: libc.unshare(0x10000000 | 0x00020000),
        'unshare_mount': lambda: libc.unshare(0x00020000),
        'setns': lambda: libc.setns(os.open('/dev/null', os.O_RDONLY), 0),
        'clone_user': lambda: libc.syscall({clone}, 0x10000000 | 17, 0, 0, 0, 0)}}.items():
    ctypes.set_errno(0)
    rc = call()
    if rc == 0 and name == 'clone_user':
        os._exit(0)  # the child, in its new user namespace
    errors[name] = ctypes.get_errno() if rc < 0 else 0
if hasattr(os, 'unshare'):  # Python 3.12+
    try:
        os.unshare(os.CLONE_NEWUSER)
        errors['os.unshare'] = 0
    except OSError as e:
        errors['os.unshare'] = e.errno
print(errors)
"""
    for processes in (1, 8):
        r = sandbox.run(program, max_processes=processes, timeout_s=20)
        assert r.passed, r.stderr[-500:]
        errors = ast.literal_eval(r.stdout.strip().splitlines()[-1])
        assert errors and set(errors.values()) == {1}, (processes, errors)  # EPERM, each


def _bpf(program: bytes, nr: int, arch: int, arg0: int = 0) -> int:
    """What a classic-BPF seccomp filter returns for one call (the few instructions the sandbox's uses)."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)  # struct seccomp_data
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = struct.unpack_from("=HBBI", program, 8 * pc)
        if code == 0x06:  # ret
            return k
        if code == 0x20:  # ld [k]
            acc, pc = struct.unpack_from("=I", data, k)[0], pc + 1
            continue
        taken = {0x15: acc == k, 0x25: acc > k, 0x35: acc >= k, 0x45: bool(acc & k)}[
            code
        ]  # jeq, jgt, jge, jset
        pc += 1 + (jt if taken else jf)


def test_the_filter_refuses_the_same_calls_on_both_architectures():
    """The filter is installed only on the machine the tests run on: its program for the other one is
    checked here, by interpreting it, with each architecture's own numbers (aarch64's openat is
    x86_64's clone)."""
    allow, eperm, enosys = 0x7FFF0000, 0x50001, 0x50026
    thread = (
        0x3D0F00  # glibc's pthread_create: CLONE_VM|FS|FILES|SIGHAND|THREAD|SYSVSEM|SETTLS|*_TID
    )
    numbers = {
        "x86_64": (
            0xC000003E,
            dict(
                read=0,
                openat=257,
                shmget=29,
                msgget=68,
                semget=64,
                mq_open=240,
                memfd_create=319,
                unshare=272,
                setns=308,
                clone=56,
                clone3=435,
            ),
        ),
        "aarch64": (
            0xC00000B7,
            dict(
                read=63,
                openat=56,
                shmget=194,
                msgget=186,
                semget=190,
                mq_open=180,
                memfd_create=279,
                unshare=97,
                setns=268,
                clone=220,
                clone3=435,
            ),
        ),
    }
    for machine, (arch, nr) in numbers.items():
        for processes in (False, True):
            prog = sandbox_seccomp.seccomp_filter(processes, machine)
            got = {name: _bpf(prog, n, arch) for name, n in nr.items() if name != "clone"}
            assert got == {
                **{k: eperm for k in got},
                "read": allow,
                "openat": allow,
                "clone3": enosys,
            }, machine
            assert _bpf(prog, nr["clone"], arch, thread) == allow
            assert _bpf(prog, nr["clone"], arch, 17) == (
                allow if processes else eperm
            )  # a fork: SIGCHLD
            assert _bpf(prog, nr["clone"], arch, 0x10000000 | 17) == eperm  # CLONE_NEWUSER
            assert _bpf(prog, nr["read"], 0x40000003) == eperm  # i386's int 0x80
    x86 = sandbox_seccomp.seccomp_filter(False, "x86_64")
    assert _bpf(x86, 0x40000000 | 29, 0xC000003E) == eperm  # x32's shmget
    assert _bpf(x86, 57, 0xC000003E) == _bpf(x86, 58, 0xC000003E) == eperm  # fork, vfork
    assert _bpf(sandbox_seccomp.seccomp_filter(True, "x86_64"), 57, 0xC000003E) == allow
    assert sandbox_seccomp.seccomp_filter(False, "riscv64") is None


# each architecture's numbers (its unistd.h) of calls the sandbox's processes never need: a large kernel surface
UNNAMED = {
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "userfaultfd": (323, 282),
    "bpf": (321, 280),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "perf_event_open": (298, 241),
    "mount": (165, 40),
    "open_by_handle_at": (304, 265),
    "fsopen": (430, 430),
    "a call of a later kernel": (470, 470),
}


def test_the_filter_is_an_allowlist():
    """A call the filter does not name answers ENOSYS (issue 48: io_uring_setup succeeded in the root and
    user-namespace modes, a surface whose operations the filter never sees): checked for every number up to
    the next kernel's, on both architectures, by interpreting the program."""
    allow, eperm, enosys = 0x7FFF0000, 0x50001, 0x50026
    for machine, col in sandbox_seccomp.MACHINES.items():
        arch = sandbox_seccomp.AUDIT_ARCH[col]
        allowed = {nrs[col] for nrs in sandbox_seccomp.ALLOWED.values()} - {None}
        refused = {nrs[col] for nrs in sandbox_seccomp.REFUSED.values()}
        assert not allowed & refused and not allowed & {nrs[col] for nrs in UNNAMED.values()}
        prog = sandbox_seccomp.seccomp_filter(False, machine)
        got = {nr: _bpf(prog, nr, arch, 0x3D0F00) for nr in range(600)}
        clone, forks = sandbox_seccomp.CLONE[col], set(sandbox_seccomp.FORKS[col])
        assert {nr for nr, r in got.items() if r == allow} == allowed | {clone}, machine
        assert {nr for nr, r in got.items() if r == eperm} == refused | forks, machine
        assert {nr for nr, r in got.items() if r == enosys} == set(
            range(600)
        ) - allowed - refused - forks - {clone}
        assert all(got[nrs[col]] == enosys for nrs in UNNAMED.values()), machine


def test_calls_not_named_are_refused_inside_the_sandbox(kind):
    """io_uring, userfaultfd, bpf, keyctl and add_key, made for real by the model's code: each answers ENOSYS
    (unfiltered, this kernel answers io_uring_setup and keyctl with a descriptor and a key id), while a
    program doing ordinary things (imports, arithmetic, strings, exceptions, its own stdin, files, a thread)
    passes."""
    _needs_filter()
    col = sandbox_seccomp.MACHINES[os.uname().machine]
    calls = {
        name: nrs[col]
        for name, nrs in UNNAMED.items()
        if name in ("io_uring_setup", "userfaultfd", "bpf", "keyctl", "add_key")
    }
    program = f"""import ctypes
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(256)
args = {{'io_uring_setup': (8, buf), 'userfaultfd': (0,), 'bpf': (0, buf, 72), 'keyctl': (0, -3, 0),
        'add_key': (b'user', b'tinygpt', b'x', 1, -2)}}
errors = {{}}
for name, nr in {calls!r}.items():
    ctypes.set_errno(0)
    rc = libc.syscall(nr, *args[name])
    errors[name] = ctypes.get_errno() if rc < 0 else 0
print(errors)
"""
    r = sandbox.run(program, timeout_s=20)
    assert r.passed, r.stderr[-500:]
    assert ast.literal_eval(r.stdout.strip().splitlines()[-1]) == {
        name: 38 for name in calls
    }  # ENOSYS, each
    ordinary = """import collections, fractions, json, math, os, re, statistics, sys, threading
data = sys.stdin.read()
words = re.findall(r"[a-z]+", "the cat and the hat " + data)
assert collections.Counter(words).most_common(1) == [("the", 2)]
assert math.isclose(statistics.mean([1, 2, 4]), 7 / 3) and fractions.Fraction(6, 4) == fractions.Fraction(3, 2)
try:
    json.loads("{")
except ValueError as e:
    print("refused:", type(e).__name__)
open("scratch.txt", "w").write("x" * 100)
assert os.path.getsize("scratch.txt") == 100 and "scratch.txt" in os.listdir(".")
out = []
t = threading.Thread(target=lambda: out.append(sum(range(10))))
t.start(); t.join()
print(out[0], " ".join(w.upper() for w in words))
"""
    r = sandbox.run(ordinary, timeout_s=20)
    assert r.passed, r.stderr[-500:]
    assert r.stdout.splitlines() == ["refused: JSONDecodeError", "45 THE CAT AND THE HAT"]


# --- through the CLI ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("sandbox-cli")
    pretrain(
        "cpu-smoke",
        tmp / "run",
        max_steps=2,
        save_every=2,
        eval_every=2,
        progress=False,
        device="cpu",
        cache_dir=tmp / "cache",
    )
    return tmp / "run"


def _humaneval_file(path: Path, records: list[dict]) -> Path:
    with gzip.open(path, "wt") as f:
        for i, r in enumerate(records):
            f.write(
                json.dumps(
                    {
                        "task_id": f"Evil/{i}",
                        "canonical_solution": "    return 1\n",
                        "entry_point": "f",
                        **r,
                    }
                )
                + "\n"
            )
    return path


def _cli(*argv, env=None, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "tinygpt", *map(str, argv)],
        capture_output=True,
        text=True,
        env=env,
        **kw,
    )


@pytest.mark.slow  # the CLI in a subprocess
def test_a_crafted_humaneval_file_escapes_nothing_through_the_cli(run, tmp_path, victim):
    if sandbox.boundary().kind == "none":
        pytest.skip(f"no kernel boundary here: {sandbox.boundary().why_not}")
    proof = tmp_path / "proof.txt"
    records = [
        {
            "prompt": f'{attack}\ndef f():\n    """one"""\n',
            "test": "def check(candidate):\n    assert False\n",
        }
        for attack in _attacks(proof, victim).values()
    ]
    # the carrier: the prompt opens a string that the test closes, around the model's output
    records.append(
        {
            "prompt": 'def f():\n    """one"""\n_junk = r\'\'\'',
            "test": f"'''\n{_attacks(proof, victim)['dir_fd']}\ndef check(candidate):\n    pass\n",
        }
    )
    data = _humaneval_file(tmp_path / "evil.jsonl.gz", records)
    p = _cli(
        "eval",
        run,
        "--task",
        "humaneval",
        "--data",
        data,
        "--max-new-tokens",
        4,
        "--device",
        "cpu",
        "--json",
    )
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["pass@1"] == 0 and res["sandbox"] in ("root", "userns")
    assert all(s != "passed" for prob in res["per_problem"] for s in prob["statuses"])
    assert not proof.exists() and victim.read_text() == "keep me"
    assert "kernel boundary" in p.stderr.splitlines()[0]  # said first, with the boundary used


def test_no_boundary_refuses_unless_unsafe_exec(run, tmp_path, monkeypatch, capfd):
    data = _humaneval_file(
        tmp_path / "ok.jsonl.gz",
        [
            {
                "prompt": 'def f():\n    """one"""\n',
                "test": "def check(candidate):\n    assert candidate() == 1\n",
            }
        ],
    )
    monkeypatch.setenv(
        "TINYGPT_SANDBOX", "none"
    )  # as on a machine with neither root nor user namespaces
    args = [
        "eval",
        str(run),
        "--task",
        "humaneval",
        "--data",
        str(data),
        "--max-new-tokens",
        "4",
        "--device",
        "cpu",
    ]
    assert main(args) == 2
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "no kernel boundary" in err and "--unsafe-exec" in err and "checkpoint" not in err
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    tempfile.tempdir = None  # read TMPDIR again
    try:
        assert main([*args, "--json", "--unsafe-exec"]) == 0
    finally:
        tempfile.tempdir = None
    assert json.loads(capfd.readouterr().out)["sandbox"] == "none" and not list(
        tmp_path.glob("tinygpt-exec-*")
    )


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _sigint_as_from_a_terminal() -> None:
    """In the child before exec: SIGINT back to its default. pytest-xdist's workers ignore SIGINT, a child
    inherits an ignored signal, and Python then raises no KeyboardInterrupt (as for a background job): the
    command would run on and exit 0 (the suite failed so three times in a row, alone it passed)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow  # real processes stopped
@pytest.mark.parametrize(
    "mode,sig", [("root", signal.SIGTERM), ("uid", signal.SIGTERM), ("none", signal.SIGINT)]
)
def test_a_signal_mid_eval_leaves_no_process_and_no_folder(run, tmp_path, mode, sig):
    """SIGTERM (or Ctrl-C) while programs run: `tinygpt eval` exits 130, and every launcher, sandbox
    process and /tmp/tinygpt-exec-* folder is gone (at 0f7fccf `sleep` children reparented to 1)."""
    if mode != "none" and sandbox.boundary(mode).kind != mode:
        pytest.skip(f"no {mode} boundary here")
    # the solution sleeps whatever the model writes: its one token goes into the prompt's last comment (an
    # untrained model's two tokens were once "iz context", a syntax error that ended every program at once)
    slow = {
        "prompt": "import time\ntime.sleep(60)\ndef f():\n    return 1\n# ",
        "test": "def check(c):\n    pass\n",
    }
    data = _humaneval_file(tmp_path / "slow.jsonl.gz", [slow] * 6)
    folders = tmp_path / "tmp"
    folders.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TINYGPT_SANDBOX": mode, "TMPDIR": str(folders)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tinygpt",
            "eval",
            str(run),
            "--task",
            "humaneval",
            "--data",
            str(data),
            "--max-new-tokens",
            "1",
            "--device",
            "cpu",
            "--unsafe-exec",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_sigint_as_from_a_terminal,
    )
    deadline, seen = time.monotonic() + 120, set()
    while time.monotonic() < deadline and proc.poll() is None:
        seen = _descendants(proc.pid)
        running = sum("-c" in _cmdline(Path(f"/proc/{p}")) for p in seen)  # the sandboxed processes
        if running >= 2 and (mode != "none" or list(folders.glob("tinygpt-exec-*"))):
            break
        time.sleep(0.1)
    assert proc.poll() is None and seen, "no sandbox started"
    time.sleep(0.3)
    seen |= _descendants(proc.pid)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    # (the -2 and -15 seen before were programs that ended at once, a syntax error in the model's words, so
    # the signal came after the command had finished: the solution now sleeps whatever the model writes)
    assert proc.returncode == 130 and b"interrupted" in err, (proc.returncode, err[-500:])
    time.sleep(0.2)
    alive = [p for p in seen if Path(f"/proc/{p}").exists() and _cmdline(Path(f"/proc/{p}"))]
    assert not alive, [_cmdline(Path(f"/proc/{p}")) for p in alive]
    assert not list(folders.iterdir())


# --- the syntax metric (issue 26 item 1) ----------------------------------------------------------


def test_syntax_accuracy_judges_what_the_model_wrote(shared_data):
    prob = load_humaneval(shared_data / "HumanEval.jsonl.gz")[0]
    answers = {
        "empty": "",
        "whitespace": "\n\n   \n",
        "comment": "    # TODO\n",
        "top_level_only": "\nx = 1\n",
        "valid": prob.canonical_solution,
        "invalid": "    return (\n",
        "valid_but_wrong": "    return None\n",
    }
    expected = {
        "empty": False,
        "whitespace": False,
        "comment": False,
        "top_level_only": False,
        "valid": True,
        "invalid": False,
        "valid_but_wrong": True,
    }
    assert {k: prob.valid_syntax(a) for k, a in answers.items()} == expected
    it = iter(answers.values())
    r = code.evaluate_code(
        [prob] * len(answers), lambda _: next(it), unsafe=sandbox.boundary().kind == "none"
    )
    assert r["syntax_accuracy"] == pytest.approx(2 / 7)
    assert r["pass@1"] == pytest.approx(
        1 / 7
    )  # on the same completions: only the canonical one passes
    assert [p["statuses"][0] == "passed" for p in r["per_problem"]] == [
        k == "valid" for k in answers
    ]
    mbpp = load_mbpp(shared_data / "mbpp.jsonl")[0]
    assert [
        mbpp.valid_syntax(a) for a in ("", "  \n", "# nothing\n", mbpp.canonical_solution, "def (:")
    ] == [False, False, False, True, False]


def test_code_generation_stops_at_the_context_with_one_line_of_ours(run, tmp_path, capfd):
    """Issue 26 item 1, issue 38: a prompt past the context the model was trained at (64 for the cpu-smoke
    run folder and for its export, which advertises it, issue 39) is cut from the left to leave room for an
    answer, said once by tinygpt and counted, never transformers' reminder."""
    words = " ".join(f"w{i}" for i in range(40))
    data = _humaneval_file(
        tmp_path / "long.jsonl.gz",
        [
            {
                "prompt": f'def f():\n    """{words}"""\n',
                "test": "def check(candidate):\n    pass\n",
            },
            {
                "prompt": f'def f():\n    """{words * 3}"""\n',
                "test": "def check(candidate):\n    pass\n",
            },
        ],
    )
    hf = tmp_path / "hf"
    assert main(["export", str(run), str(hf)]) == 0
    unsafe = ["--unsafe-exec"] if sandbox.boundary().kind == "none" else []
    for model, context in ((run, 64), (hf, 64)):
        capfd.readouterr()
        assert (
            main(
                [
                    "eval",
                    str(model),
                    "--task",
                    "humaneval",
                    "--data",
                    str(data),
                    "--max-new-tokens",
                    "200",
                    "--device",
                    "cpu",
                    "--json",
                    *unsafe,
                ]
            )
            == 0
        )
        out, err = capfd.readouterr()
        notes = [ln for ln in err.splitlines() if "context" in ln and "note:" in ln]
        assert len(notes) == 1 and f"{context}-token context" in notes[0], err
        assert "predefined maximum length" not in err
        assert (
            json.loads(out)["prompts_cut"] >= 1
        )  # the long prompt, cut to leave room for its answer
