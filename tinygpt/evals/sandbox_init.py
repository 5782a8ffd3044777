"""What runs inside the sandbox (tinygpt/evals/sandbox.py starts it): standard library only, because
the same file is run three ways and never imports tinygpt:

- ``python -I -S sandbox_init.py supervise``: the supervisor. Reads one job (marshal) on stdin, builds
  the jail (in namespace modes it is PID 1 of a new PID namespace and owns a private mount
  namespace: a size-capped tmpfs becomes ``/``, with ``/usr``, the Python install and five device
  files bound read-only, so nothing else of the machine exists in there), starts the two
  processes below (under the rlimits and a system call filter: no new process, SysV IPC, memfd
  or namespace; see "the system call filter"), waits, kills everything, and prints one result
  (a dict literal) on stdout. Its stdout is the only channel to the caller, and no child holds it.
- ``python -I -S -c <this source> test``: the test process (uid B). Runs the problem's context and
  test code; the candidate is a proxy that calls into the solution process through two pipes.
  When the test code has run to its end it writes ``P`` on its result pipe (held by it and the
  supervisor only) and exits 0.
- ``python -I -S -c <this source> serve``: the solution process (uid A). Runs the model's code,
  then answers calls.

Why the verdict cannot be forged by the model's code: it runs in another process, under another
uid (root modes) or without capabilities next to a non-dumpable test process (user-namespace
mode), so it cannot write the test's memory, read its pipes or signal it into a pass (killing it
is a fail). It can only answer calls, and answers cross as plain values (int, float, str, bytes,
bool, None and lists, tuples, sets, dicts of them) decoded by ``ast.literal_eval`` from a
size-capped message: no pickle, no code, no objects whose ``__eq__`` it wrote. Where a problem
needs the solution's own objects (MBPP's ``Node``), the test holds an opaque handle: attributes,
calls, iteration and indexing go to the solution, comparisons are by identity, so a handle
never equals an expected value. The test process starts first and makes itself non-dumpable
before the solution process exists.
"""
from __future__ import annotations

import ast
import builtins
import os
import sys

MAX_MESSAGE = 8 * 2**20      # bytes in one call or answer
MAX_DEPTH = 200              # nesting of one value
RESULT_READY, RESULT_PASSED = b"R", b"P"
LINK_BROKEN = 3              # the test process's exit code when the solution process stopped answering


# --- values across the pipe -------------------------------------------------------------------

class Handle:
    """An object of the solution's that is not a plain value: only its number crosses."""

    def __init__(self, num: int) -> None:
        self.num = num


def encode(v, handle=None, depth: int = 0):
    """A plain value as a tagged tree of literals; anything else through `handle(v)` (None: refused)."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deep")
    if v is None:
        return ("N",)
    if isinstance(v, Handle):
        return ("h", v.num)
    # Subclasses of the plain types (Counter, OrderedDict, namedtuple, IntEnum...) cross as their
    # plain base: they compare as it does, and an overridden __eq__ stays behind.
    if isinstance(v, bool):
        return ("B", bool(v))
    if isinstance(v, int):
        return ("i", format(int(v), "x"))  # hex: no limit on digits, unlike str(int)
    if isinstance(v, float):
        return ("f", float(v).hex())
    if isinstance(v, complex):
        v = complex(v)
        return ("c", v.real.hex(), v.imag.hex())
    if isinstance(v, str):
        return ("s", str(v))
    if isinstance(v, bytes):
        return ("b", bytes(v))
    for base, tag in ((list, "l"), (tuple, "t"), (set, "S"), (frozenset, "F")):
        if isinstance(v, base):
            return (tag, [encode(x, handle, depth + 1) for x in base(v)])
    if isinstance(v, dict):
        return ("d", [(encode(k, handle, depth + 1), encode(x, handle, depth + 1)) for k, x in dict(v).items()])
    if handle is None:
        raise TypeError(f"a {type(v).__name__} is not a plain value (int, float, str, bytes, bool, None, or a list, "
                        "tuple, set or dict of them)")
    return ("h", handle(v))


def decode(tree, resolve, depth: int = 0):
    if depth > MAX_DEPTH or not isinstance(tree, tuple) or not tree:
        raise ValueError("malformed value")
    tag = tree[0]
    if tag == "N":
        return None
    if tag == "B" and type(tree[1]) is bool:
        return tree[1]
    if tag == "i":
        return int(tree[1], 16)
    if tag == "f":
        return float.fromhex(tree[1])
    if tag == "c":
        return complex(float.fromhex(tree[1]), float.fromhex(tree[2]))
    if tag == "s" and type(tree[1]) is str or tag == "b" and type(tree[1]) is bytes:
        return tree[1]
    if tag in ("l", "t", "S", "F"):
        items = [decode(x, resolve, depth + 1) for x in tree[1]]
        return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](items)
    if tag == "d":
        return {decode(k, resolve, depth + 1): decode(x, resolve, depth + 1) for k, x in tree[1]}
    if tag == "h" and type(tree[1]) is int:
        return resolve(tree[1])
    raise ValueError(f"malformed value (tag {tag!r})")


def send(fd: int, msg) -> None:
    data = repr(msg).encode("utf-8", "surrogatepass")
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"a value of {len(data)} bytes is over the {MAX_MESSAGE}-byte limit")
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data):]


def _read_exact(fd: int, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


def receive(fd: int):
    n = int.from_bytes(_read_exact(fd, 4), "big")
    if n > MAX_MESSAGE:
        raise ValueError(f"a message of {n} bytes is over the {MAX_MESSAGE}-byte limit")
    return ast.literal_eval(_read_exact(fd, n).decode("utf-8", "surrogatepass"))


# --- the solution process ---------------------------------------------------------------------

OPS = {"__len__": len, "__iter__": iter, "__next__": next, "__getitem__": lambda o, k: o[k],
       "__setitem__": lambda o, k, v: o.__setitem__(k, v), "__delitem__": lambda o, k: o.__delitem__(k),
       "__contains__": lambda o, k: k in o, "__str__": str, "__repr__": repr}


def serve(job: dict, requests: int, answers: int) -> None:
    """Run the solution, say which names it defined, then answer calls until the test hangs up."""
    env = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(job["program"], "solution.py", "exec"), env)
    objects: dict[int, object] = {}
    numbers: dict[int, int] = {}

    def handle(v) -> int:
        if not job["handles"]:
            raise TypeError(f"returned a {type(v).__name__}, not a plain value")
        num = numbers.setdefault(id(v), len(objects))
        objects[num] = v
        return num

    names = [(k, v.__name__ if type(v) is type(sys) else None) for k, v in env.items()
             if isinstance(k, str) and k.isidentifier() and not k.startswith("__")]
    send(answers, ("names", names))
    while True:
        try:
            req = receive(requests)
        except EOFError:
            return
        try:
            kind, target = req[0], req[1]
            obj = objects[target[1]] if target[0] == "h" else env[target[1]]
            if kind == "call":
                res = obj(*decode(req[2], objects.__getitem__), **decode(req[3], objects.__getitem__))
            elif kind == "get" and type(req[2]) is str:
                res = getattr(obj, req[2])
            elif kind == "set" and type(req[2]) is str:
                res = setattr(obj, req[2], decode(req[3], objects.__getitem__))
            elif kind == "op" and req[2] in OPS:
                res = OPS[req[2]](obj, *decode(req[3], objects.__getitem__))
                if req[2] in ("__str__", "__repr__") and type(res) is not str:
                    raise TypeError(f"{req[2]} returned a non-string")
            else:
                raise ValueError(f"unknown request {kind!r}")
            answer = ("ok", encode(res, handle))
        except StopIteration:
            answer = ("stop",)
        except Exception as e:  # the test sees the solution's exception
            answer = ("err", type(e).__name__, str(e)[:2000])
        send(answers, answer)


# --- the test process -------------------------------------------------------------------------

class LinkBroken(Exception):
    """The solution process stopped answering (it exited, crashed or was killed)."""


class RemoteError(Exception):
    """An exception raised in the solution whose type is not a built-in one."""


class Remote:
    """An object living in the solution process (a function, a class, an instance, an iterator)."""

    def __init__(self, link, target) -> None:
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_target", target)

    def _ask(self, *req):
        return self._link.ask(self._target, *req)

    def __call__(self, *args, **kwargs):
        return self._ask("call", args, kwargs)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._ask("get", name)

    def __setattr__(self, name, value):
        self._ask("set", name, value)

    def __len__(self):
        return self._ask("op", "__len__", ())

    def __iter__(self):
        return self._ask("op", "__iter__", ())

    def __next__(self):
        return self._ask("op", "__next__", ())

    def __getitem__(self, k):
        return self._ask("op", "__getitem__", (k,))

    def __setitem__(self, k, v):
        self._ask("op", "__setitem__", (k, v))

    def __delitem__(self, k):
        self._ask("op", "__delitem__", (k,))

    def __contains__(self, k):
        return self._ask("op", "__contains__", (k,))

    def __str__(self):
        return self._ask("op", "__str__", ())

    def __repr__(self):
        return self._ask("op", "__repr__", ())


class Link:
    def __init__(self, requests: int, answers: int) -> None:
        self.requests, self.answers = requests, answers
        self.handles: dict[int, Remote] = {}

    def _remote(self, num: int) -> Remote:
        if num not in self.handles:
            self.handles[num] = Remote(self, ("h", num))
        return self.handles[num]

    def _encode(self, v, depth=0):
        if isinstance(v, Remote):
            if v._target[0] != "h":
                raise TypeError("a function of the solution cannot be passed back to it")
            return ("h", v._target[1])
        if type(v) in (list, tuple, set, frozenset) and depth < MAX_DEPTH:
            tag = {list: "l", tuple: "t", set: "S", frozenset: "F"}[type(v)]
            return (tag, [self._encode(x, depth + 1) for x in v])
        if type(v) is dict and depth < MAX_DEPTH:
            return ("d", [(self._encode(k, depth + 1), self._encode(x, depth + 1)) for k, x in v.items()])
        return encode(v)

    def receive(self):
        try:
            return receive(self.answers)
        except (EOFError, OSError) as e:
            raise LinkBroken("the solution's process ended") from e

    def ask(self, target, kind, *rest):
        if kind == "call":
            req = ("call", target, self._encode(rest[0]), self._encode(rest[1]))
        elif kind in ("get", "set"):
            req = (kind, target, rest[0]) + ((self._encode(rest[1]),) if kind == "set" else ())
        else:
            req = ("op", target, rest[0], self._encode(rest[1]))
        try:
            send(self.requests, req)
        except (BrokenPipeError, OSError) as e:
            raise LinkBroken("the solution's process ended") from e
        answer = self.receive()
        if answer[0] == "ok":
            return decode(answer[1], self._remote)
        if answer[0] == "stop":
            raise StopIteration
        name, message = str(answer[1]), str(answer[2])
        cls = getattr(builtins, name, None)
        if isinstance(cls, type) and issubclass(cls, Exception) and cls is not StopIteration:
            raise cls(message)
        raise RemoteError(f"{name}: {message}")


def _set_dumpable(flag: int) -> None:
    """Nobody without CAP_SYS_PTRACE may ptrace this process or open its /proc files."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(4, flag, 0, 0, 0)  # PR_SET_DUMPABLE
    except (OSError, AttributeError):
        pass


def test(job: dict, result: int, requests: int | None, answers: int | None) -> None:
    """Run context + proxies + test; write RESULT_PASSED when the test code ran to its end."""
    _set_dumpable(0)
    os.write(result, RESULT_READY)  # only now is the solution process started
    env = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(job["context"], "problem.py", "exec"), env)
    try:
        if requests is not None:
            link = Link(requests, answers)
            hello = link.receive()
            if hello[0] != "names":
                raise ValueError("the solution's process sent no list of names")
            wanted = job["names"]
            if wanted is not None:  # exactly these names, over the prompt's stubs; nothing else of the solution
                for name in wanted:
                    env[name] = Remote(link, ("n", name))
            else:
                for name, module in hello[1][:10_000]:
                    if not (isinstance(name, str) and name.isidentifier()):
                        continue
                    if isinstance(module, str) and module in getattr(sys, "stdlib_module_names", ()):
                        try:  # `import math` in the solution: the test gets the real module
                            env[name] = __import__(module)
                        except Exception:
                            pass
                        continue
                    env[name] = Remote(link, ("n", name))
        exec(compile(job["test"], "test.py", "exec"), env)
    except SystemExit as e:  # the test code exited before its end: no verdict
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        sys.stdout.flush()
        os._exit(code)
    except LinkBroken:
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(LINK_BROKEN)
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(result, RESULT_PASSED)
    os._exit(0)


def child_main(role: str) -> None:
    """The entry point of a child (run with -c): the job on stdin, descriptors in the environment."""
    import marshal
    job = marshal.loads(sys.stdin.buffer.read())  # from the supervisor
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    fds = [int(x) for x in os.environ.pop("TINYGPT_SANDBOX_FDS").split(",") if x]
    if role == "serve":
        serve(job, fds[0], fds[1])
    else:
        test(job, fds[0], *(fds[1:3] if len(fds) == 3 else (None, None)))



# --- the supervisor ---------------------------------------------------------------------------

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
_KEPT_FLAGS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
               "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
DEVICES = ("null", "zero", "full", "random", "urandom")


class Jail:
    """The mount side of the namespace modes: a size-capped tmpfs as the new `/`, read-only binds."""

    def __init__(self) -> None:
        import ctypes
        self.ctypes = ctypes
        self.libc = ctypes.CDLL(None, use_errno=True)

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            err = self.ctypes.get_errno()
            raise OSError(err, f"sandbox: {what}: {os.strerror(err)}")

    def mount(self, src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        def enc(s: str | None) -> bytes | None:
            return None if s is None else s.encode()

        self._check(self.libc.mount(enc(src), enc(target), enc(fstype), self.ctypes.c_ulong(flags), enc(data)),
                    f"mount {target}")

    @staticmethod
    def mounts_under(path: str) -> list[tuple[str, int]]:
        """(mount point, the flags a remount must keep) for `path` and every mount below it."""
        out = []
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                fields = line.split()
                point = fields[4].encode("latin-1", "surrogateescape").decode("unicode_escape")
                if point == path or point.startswith(path.rstrip("/") + "/"):
                    flags = 0
                    for opt in fields[5].split(","):
                        flags |= _KEPT_FLAGS.get(opt, 0)
                    out.append((point, flags))
        return out

    def bind_read_only(self, src: str, target: str, extra: int = MS_NOSUID | MS_NODEV) -> None:
        self.mount(src, target, None, MS_BIND | MS_REC)
        for point, flags in self.mounts_under(target):  # a bind's read-only flag covers its top mount only
            self.mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra | flags)

    def build(self, job: dict, root: str = "/tmp") -> None:
        """Mount the new root at `root` (a private mount of this namespace: the host's folder is
        untouched), fill it, pivot into it and drop the old root."""
        self.mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                   f"size={job['max_write_bytes']},nr_inodes=16384,mode=755")
        bound: list[str] = []
        for path in job["read_only"]:
            if any(path == b or path.startswith(b + "/") for b in bound) or not os.path.lexists(path):
                continue
            inside = root + path
            os.makedirs(os.path.dirname(inside), exist_ok=True)
            if os.path.islink(path):  # /bin -> usr/bin on merged-/usr systems
                os.symlink(os.readlink(path), inside)
            elif os.path.isdir(path):
                os.makedirs(inside, exist_ok=True)
                self.bind_read_only(path, inside)
                bound.append(path)
        os.makedirs(root + "/dev", exist_ok=True)
        for name in DEVICES:
            open(f"{root}/dev/{name}", "w").close()
            self.mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
            flags = self.mounts_under(f"{root}/dev/{name}")[-1][1]
            self.mount(None, f"{root}/dev/{name}", None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NOEXEC | flags)
        os.mkdir(root + "/tmp")
        os.chmod(root + "/tmp", 0o1777)
        os.mkdir(root + "/.out")  # the outputs: their own tmpfs, so that a full jail still shows why
        self.mount("tmpfs", root + "/.out", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                   f"size={4 * job['max_output_bytes'] + 2**20},mode=700")
        os.chdir(root)
        number = _PIVOT_ROOT.get(os.uname().machine)
        if number is not None:
            self._check(self.libc.syscall(number, b".", b"."), "pivot_root")
            self._check(self.libc.umount2(b".", 2), "detach the old root")  # MNT_DETACH
        else:
            os.chroot(".")
        os.chdir("/")

    def drop_capabilities(self) -> None:
        """All capabilities, also those an exec as uid 0 of a user namespace would grant again."""
        for cap in range(64):
            self.libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP; past the last cap: EINVAL
        header = (self.ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        data = (self.ctypes.c_uint32 * 6)()
        self._check(self.libc.capset(header, data), "capset")
        self.libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL


def _limits(job: dict, libc, drop_capabilities, seccomp: bytes | None) -> None:
    """In the child after fork (after setgroups/setgid/setuid in root mode), before exec. With the system call
    filter (`seccomp`), RLIMIT_NPROC leaves room for THREADS threads (MALLOC_ARENA_MAX=1 keeps each one's
    cost to its stack): the filter, not the rlimit, refuses the new processes."""
    import resource  # already imported by the supervisor: the child's uid may not read the stdlib

    def limit(which: int, soft: int, hard: int | None = None) -> None:
        cur = resource.getrlimit(which)[1]
        hard = soft if hard is None else hard
        if cur != resource.RLIM_INFINITY:
            soft, hard = min(soft, cur), min(hard, cur)
        resource.setrlimit(which, (soft, hard))

    limit(resource.RLIMIT_AS, job["memory_bytes"])
    limit(resource.RLIMIT_CPU, job["cpu_s"], job["cpu_s"] + 1)  # SIGXCPU first (SIGKILL would hide why)
    limit(resource.RLIMIT_FSIZE, job["max_output_bytes"])
    limit(resource.RLIMIT_CORE, 0)
    limit(resource.RLIMIT_NOFILE, 64)
    limit(resource.RLIMIT_NPROC, job["max_processes"] + (THREADS if seccomp is not None else 0))
    if drop_capabilities is not None:
        drop_capabilities()
    if libc is not None:
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: no setuid binary or file capability helps
    if seccomp is not None:
        _install_filter(libc, seccomp)


# --- the system call filter -------------------------------------------------------------------
#
# Installed in each child before exec (kept across exec, inherited by threads), on the two architectures
# whose numbers are below. What no sandboxed process may do, with EPERM:
# - SysV IPC and POSIX message queues: shared memory held outside RLIMIT_AS (3 GB past a 1 GB limit) and,
#   in the uid mode, in the host's namespace, kept after the sandbox ends;
# - memfd_create, memfd_secret: memory files outside the jail's size-capped tmpfs (~1 GB past the limit);
# - unshare, setns, and clone with a CLONE_NEW* flag: a user namespace gives back every capability in
#   it, and with them a mount of any size;
# - with max_processes=1, a new process: clone without CLONE_THREAD, fork, vfork. Threads are a clone
#   with CLONE_THREAD, allowed (RLIMIT_NPROC allows THREADS of them).
# clone3 answers ENOSYS: its flags are in memory the filter cannot read, and glibc then uses clone.
# Another architecture's calls (i386's int 0x80, x32's numbers on x86_64) are refused whole.

THREADS = 32  # a thread pool's worth (ThreadPoolExecutor's default is at most 32 workers)
CLONE_THREAD = 0x00010000
CLONE_NEW = 0x7E020080  # NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET|NEWTIME (all in the low 32 bits)
_SYSCALLS = {  # machine: (AUDIT_ARCH_*, refused, clone, clone3, fork and vfork)
    "x86_64": (0xC000003E, (29, 30, 31, 67,  # shmget shmat shmctl shmdt
                            64, 65, 66, 220,  # semget semop semctl semtimedop
                            68, 69, 70, 71,  # msgget msgsnd msgrcv msgctl
                            240, 241, 242, 243, 244, 245,  # mq_open .. mq_getsetattr
                            319, 447,  # memfd_create memfd_secret
                            272, 308),  # unshare setns
               56, 435, (57, 58)),
    "aarch64": (0xC00000B7, (*range(180, 198),  # mq_open .. mq_getsetattr, msg*, sem*, shm*
                             279, 447, 97, 268),  # memfd_create memfd_secret unshare setns
                220, 435, ()),
}


def seccomp_filter(processes: bool, machine: str | None = None) -> bytes | None:
    """The filter above as classic BPF (struct sock_filter[]), or None on an architecture not listed."""
    import struct
    machine = machine or os.uname().machine
    arch = _SYSCALLS.get(machine)
    if arch is None:
        return None
    audit_arch, refused, clone, clone3, forks = arch
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38  # SECCOMP_RET_ALLOW, RET_ERRNO(...)
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, audit_arch), (ret, 0, 0, eperm),  # seccomp_data.arch
            (ld, 0, 0, 0)]  # seccomp_data.nr
    if machine == "x86_64":
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, eperm)]  # x32
    for nr in refused + (() if processes else forks):
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, eperm)]
    prog += [(jeq, 0, 1, clone3), (ret, 0, 0, enosys)]
    flags = [(ld, 0, 0, 16),  # the low 32 bits of args[0] (both are little-endian), clone's flags
             (jset, 0, 1, CLONE_NEW), (ret, 0, 0, eperm)]
    if not processes:
        flags += [(jset, 1, 0, CLONE_THREAD), (ret, 0, 0, eperm)]
    flags += [(ret, 0, 0, allow)]
    prog += [(jeq, 0, len(flags), clone), *flags, (ret, 0, 0, allow)]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


def _install_filter(libc, program: bytes) -> None:
    """prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &sock_fprog), after no-new-privs; raises if refused."""
    import ctypes

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    prog = Fprog(len(program) // 8, program)
    ul = ctypes.c_ulong
    if libc.prctl(ul(22), ul(2), ctypes.byref(prog), ul(0), ul(0)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sandbox: the system call filter: {os.strerror(err)}")


def _host_libc():
    """The C library outside a jail (uid and none modes build none), for prctl; None where ctypes fails."""
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


def _spawn(job: dict, role: str, source: str, cwd: str, fds: list[int], out: str, err: str,
           uid: int | None, jail: Jail | None, drop: bool) -> tuple[int, int]:
    """fork + exec of a child: its job on a pipe as stdin, output to files, `fds` as 3, 4, 5; in the
    child, before exec: its own session, setgroups([]) / setgid / setuid (root mode), the limits,
    no-new-privs. Returns (pid, the write end of its stdin). Plain os calls: no subprocess import."""
    import fcntl
    r, w = os.pipe()
    o = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    e = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    env = {"PATH": "/usr/bin:/bin", "HOME": cwd, "TMPDIR": "/tmp", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
           "MALLOC_ARENA_MAX": "1",  # threads share the heap: a 64 MB arena each would leave room for few of them
           "TINYGPT_SANDBOX_FDS": ",".join(str(3 + i) for i in range(len(fds)))}
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
            _limits(job, libc, jail.drop_capabilities if drop else None, seccomp)
            # Its own session keeps it out of the supervisor's process group, so when the caller SIGKILLs the
            # supervisor (Ctrl-C, SIGTERM) only this signal ends it where no PID namespace does (uid, none)
            if libc is not None:
                libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG: SIGKILL (set after setuid, which would clear it)
            if os.getppid() != parent:  # the supervisor died before that: nobody would ever stop this one
                os._exit(127)
            os.execve(job["python"], [job["python"], "-I", "-S", "-c", source, role], env)
        except BaseException as ex:  # noqa: BLE001 (a child must never return into the supervisor)
            os.write(2, f"sandbox: could not start the {role} process: {ex!r}\n".encode())
        os._exit(127)
    for fd in (r, o, e):
        os.close(fd)
    return pid, w


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
    """The supervisor: read the job, build the jail and the folders, run the test process (and the solution's)
    within the time limit, kill everything of the sandbox, then print the verdict, its only output."""
    import marshal
    import resource  # noqa: F401  (for _limits in the children, which may not read the stdlib)
    import select  # noqa: F401  (these three imported before the jail is built: inside it the stdlib may be gone)
    import signal
    import time  # noqa: F401

    job = marshal.loads(sys.stdin.buffer.read())  # from tinygpt itself, not from the sandbox
    source = open(__file__, encoding="utf-8").read()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller stops us with SIGKILL
    run = _Sandbox(job, source, *_prepare(job))
    try:
        run.start_and_wait()
    finally:
        run.kill_all()
    sys.stdout.write(repr(run.verdict()))
    sys.stdout.flush()


def _no_ipc_nor_user_namespaces(job: dict) -> None:
    """Namespace modes, before the jail hides /proc: this IPC namespace is not the caller's (else stop), and
    allows no SysV segment, queue or semaphore set; in userns mode no user namespace can be made below
    this one. The filter refuses those calls already: this holds where it cannot be installed. /proc/sys
    can be read-only (a container): then the filter alone."""
    def ns(name: str) -> tuple[int, int]:
        st = os.stat(f"/proc/self/ns/{name}")
        return st.st_dev, st.st_ino

    caller = job.get("caller_ns") or {}
    if caller.get("ipc") is None:
        raise OSError("sandbox: cannot tell this IPC namespace from the caller's (no /proc/self/ns/ipc)")
    if tuple(caller["ipc"]) == ns("ipc"):
        raise OSError("sandbox: no IPC namespace of its own")
    sysctls = [("kernel/shmmni", "0"), ("kernel/msgmni", "0"), ("kernel/sem", "0 0 0 0")]
    if job["mode"] == "userns" and caller.get("user") is not None and tuple(caller["user"]) != ns("user"):
        sysctls.append(("user/max_user_namespaces", "0"))  # a limit of this user namespace only
    for name, value in sysctls:
        try:
            with open(f"/proc/sys/{name}", "w") as f:
                f.write(value)
        except OSError:
            pass


def _prepare(job: dict) -> tuple[Jail | None, str, str, dict[str, int]]:
    """The jail (root and userns modes: built, this process its PID 1) and each role's folder, owned by the
    role's uid where it has one: (jail or None, the work folder, the output folder, uid by role)."""
    mode = job["mode"]  # root | userns | uid | none
    jail = None
    if mode != "none":
        jail = Jail()
        jail.libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE: no child can ptrace this supervisor
    if mode in ("root", "userns"):
        _no_ipc_nor_user_namespaces(job)
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
    """The test process and, when there is a solution, the solution's (`serve`): their pipes (the result pipe,
    held by the test process and this one only; requests and answers between the two), their starts, the
    wait, the kill, and the verdict read from the result pipe, the exit codes and the output files."""

    def __init__(self, job: dict, source: str, jail: Jail | None, work: str, out_dir: str,
                 uids: dict[str, int]) -> None:
        import time
        self.job, self.source, self.jail, self.work, self.out_dir, self.uids = job, source, jail, work, out_dir, uids
        self.jailed = job["mode"] in ("root", "userns")
        self.two = job["solution"] is not None
        self.result_r, self.result_w = os.pipe()
        links = (*os.pipe(), *os.pipe()) if self.two else ()  # requests r/w, answers r/w
        self.links = links
        self.fds = {"test": [self.result_w, *((links[1], links[2]) if self.two else ())],
                    "serve": [links[0], links[3]] if self.two else []}
        self.pids: dict[str, int] = {}
        self.codes: dict[str, int | None] = {}
        self.deadline = time.monotonic() + job["timeout_s"]
        self.timed_out = False
        self.ready = b""

    def start(self, role: str, payload: dict) -> None:
        import marshal
        self.pids[role], stdin = _spawn(self.job, role, self.source, f"{self.work}/{role}", self.fds[role],
                                        f"{self.out_dir}/{role}.out", f"{self.out_dir}/{role}.err",
                                        self.uids.get(role), self.jail, self.job["mode"] == "userns")
        try:
            data = marshal.dumps(payload)
            while data:
                data = data[os.write(stdin, data):]
        except OSError:
            pass
        os.close(stdin)

    def start_and_wait(self) -> None:
        """Start the test process; once it has made itself non-dumpable (READY on the result pipe), the
        solution's; then wait for the test process until the deadline."""
        import select
        import time
        job = self.job
        self.start("test", {"context": job["context"], "test": job["test"], "names": job["names"]})
        os.close(self.result_w)
        if self.two:
            # The test process makes itself non-dumpable first; only then does the solution's exist.
            if select.select([self.result_r], [], [], max(0.0, self.deadline - time.monotonic()))[0]:
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
            try:
                os.killpg(pid, signal.SIGKILL)  # the process and its group
            except OSError:
                pass
        if self.jailed:
            try:
                os.kill(-1, signal.SIGKILL)  # as PID 1 of this namespace: everything else in it
            except OSError:
                pass
        for uid in self.uids.values():  # no namespace: every process of the sandbox's uids, wherever it went
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
        """status (passed only when the test process wrote PASSED and exited 0), return code, the output tails."""
        os.set_blocking(self.result_r, False)
        try:
            said = self.ready + os.read(self.result_r, 16)
        except BlockingIOError:
            said = self.ready
        tails = {}
        for role in self.pids:
            (o, o_size), (e, e_size) = _tail(f"{self.out_dir}/{role}.out"), _tail(f"{self.out_dir}/{role}.err")
            tails[role] = (o, e, max(o_size, e_size) >= self.job["max_output_bytes"])
        test_rc = self.codes["test"]
        t_out, t_err, t_flood = tails["test"]
        if self.timed_out:
            status = "timeout"
        elif test_rc == 0:
            status = "passed" if RESULT_PASSED in said else "exited_early"
        elif test_rc == LINK_BROKEN and "serve" in self.pids:
            s_rc = self.codes["serve"]
            status = "exited_early" if s_rc == 0 else _status(s_rc, tails["serve"][1], tails["serve"][2])
        else:
            status = _status(test_rc, t_err, t_flood)
        if "serve" in tails:
            s_out, s_err, _ = tails["serve"]
            t_out = s_out + t_out
            t_err = t_err + (f"\n--- the solution's process ---\n{s_err}" if s_err.strip() else "")
        return {"status": status, "returncode": None if self.timed_out else test_rc, "stdout": t_out, "stderr": t_err}


if __name__ == "__main__":
    if sys.argv[1:2] == ["supervise"]:
        supervise()
    elif sys.argv[1:2] in (["serve"], ["test"]):
        child_main(sys.argv[1])
