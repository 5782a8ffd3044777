"""The test process and the solution process of the sandbox: standard library only, and
self-contained, because the supervisor (sandbox_init.py) runs this file's source as each of them,
inside the jail where neither tinygpt nor this folder exists:

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

MAX_MESSAGE = 8 * 2**20  # bytes in one call or answer
MAX_DEPTH = 200  # nesting of one value
RESULT_READY, RESULT_PASSED = b"R", b"P"
# the test process's exit code when the solution process stopped answering
LINK_BROKEN = 3


# --- values across the pipe -------------------------------------------------------------------


class Handle:
    """An object of the solution's that is not a plain value: only its number crosses."""

    def __init__(self, num: int) -> None:
        self.num = num


def encode(v, handle=None, depth: int = 0):
    """A plain value as a tagged tree of literals; anything else via `handle(v)` (None: refused)."""
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
    d = depth + 1
    for base, tag in ((list, "l"), (tuple, "t"), (set, "S"), (frozenset, "F")):
        if isinstance(v, base):
            return (tag, [encode(x, handle, d) for x in base(v)])
    if isinstance(v, dict):
        return ("d", [(encode(k, handle, d), encode(x, handle, d)) for k, x in dict(v).items()])
    if handle is None:
        raise TypeError(
            f"a {type(v).__name__} is not a plain value (int, float, str, bytes, bool, "
            "None, or a list, tuple, set or dict of them)"
        )
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
        data = data[os.write(fd, data) :]


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

OPS = {
    "__len__": len,
    "__iter__": iter,
    "__next__": next,
    "__getitem__": lambda o, k: o[k],
    "__setitem__": lambda o, k, v: o.__setitem__(k, v),
    "__delitem__": lambda o, k: o.__delitem__(k),
    "__contains__": lambda o, k: k in o,
    "__str__": str,
    "__repr__": repr,
}


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

    names = [
        (k, v.__name__ if type(v) is type(sys) else None)
        for k, v in env.items()
        if isinstance(k, str) and k.isidentifier() and not k.startswith("__")
    ]
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
                res = obj(
                    *decode(req[2], objects.__getitem__), **decode(req[3], objects.__getitem__)
                )
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


for _op in OPS:  # len, iteration, indexing, `in`, str and repr: asked of the solution's object
    setattr(Remote, _op, lambda self, *args, _op=_op: self._ask("op", _op, args))


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
        d = depth + 1
        if type(v) in (list, tuple, set, frozenset) and depth < MAX_DEPTH:
            tag = {list: "l", tuple: "t", set: "S", frozenset: "F"}[type(v)]
            return (tag, [self._encode(x, d) for x in v])
        if type(v) is dict and depth < MAX_DEPTH:
            return ("d", [(self._encode(k, d), self._encode(x, d)) for k, x in v.items()])
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
            # exactly these names, over the prompt's stubs; nothing else of the solution
            if wanted is not None:
                for name in wanted:
                    env[name] = Remote(link, ("n", name))
            else:
                for name, module in hello[1][:10_000]:
                    if not (isinstance(name, str) and name.isidentifier()):
                        continue
                    stdlib = getattr(sys, "stdlib_module_names", ())
                    if isinstance(module, str) and module in stdlib:
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
    """A child's entry point (run with -c): the job on stdin, descriptors in the environment."""
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


if __name__ == "__main__":
    if sys.argv[1:2] in (["serve"], ["test"]):
        child_main(sys.argv[1])
