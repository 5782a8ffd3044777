"""Code metrics: extracting code from a completion, syntax accuracy, BLEU (sacrebleu), pass@k, and
running candidates against a problem's tests in a separate, limited process.

HumanEval and MBPP load into one form, `CodeProblem`: the program that is run is
``prefix + completion + "\\n\\n" + test``, and passes when it exits normally after its last line.

The sandbox guards against accidents of generated code (endless loops, memory hogs, early exits,
files left behind, a child process that outlives it), not against code written to escape it:
run untrusted code in a throwaway VM or container, as the HumanEval authors advise.
"""
from __future__ import annotations

import ast
import functools
import gzip
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence


class DataFormatError(ValueError):
    """A data file that is not in the expected format; the message says what was expected."""


def _progress(it: Iterable, total: int | None, desc: str, enabled: bool) -> Iterable:
    """A tqdm bar when asked for and installed, else the iterable itself."""
    if not enabled:
        return it
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return it
    return tqdm(it, total=total, desc=desc)


# --- extraction and syntax --------------------------------------------------------------------

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(completion: str) -> str:
    """The code in a completion: the first fenced block tagged python/py (else the first fenced
    block of any kind; an unclosed fence runs to the end), or the completion itself when it has none."""
    blocks = _FENCE.findall(completion)
    if not blocks:
        return completion
    for lang, body in blocks:
        if lang.lower() in ("python", "py", "python3"):
            return body
    return blocks[0][1]


def truncate_at_stops(completion: str, stops: Sequence[str]) -> str:
    """The completion up to the first stop sequence (a base model keeps writing past the function)."""
    cut = len(completion)
    for s in stops:
        i = completion.find(s)
        if i != -1:
            cut = min(cut, i)
    return completion[:cut]


def is_valid_python(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: null bytes
        return False
    return True


def syntax_accuracy(codes: Sequence[str]) -> float:
    """The share of code strings that `ast.parse` accepts."""
    if not codes:
        raise ValueError("syntax_accuracy needs at least one code string")
    return sum(is_valid_python(c) for c in codes) / len(codes)


# --- BLEU and pass@k --------------------------------------------------------------------------

def _bleu_metric(**sacrebleu_options: Any):
    from sacrebleu.metrics import BLEU

    return BLEU(**sacrebleu_options)


def _refs_streams(hypotheses: Sequence[str], references: Sequence[str] | Sequence[Sequence[str]]) -> list[list[str]]:
    """sacrebleu wants reference *streams* (one list per reference position); accept one reference per
    hypothesis (a list of str) or several (a list of lists of equal length)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references: give one reference "
                         "(or one list of references) per hypothesis")
    if not hypotheses:
        raise ValueError("bleu needs at least one hypothesis")
    if all(isinstance(r, str) for r in references):
        return [list(references)]
    counts = {len(r) for r in references}
    if len(counts) != 1:
        raise ValueError("every hypothesis needs the same number of references")
    return [[r[i] for r in references] for i in range(counts.pop())]


def bleu_with_signature(hypotheses: Sequence[str], references: Sequence[str] | Sequence[Sequence[str]],
                        **sacrebleu_options: Any) -> tuple[float, str]:
    """Corpus BLEU (0-100) and sacrebleu's signature (e.g. ``nrefs:1|case:mixed|eff:no|tok:13a|...``),
    to print beside the score so that it can be reproduced. Options go to `sacrebleu.metrics.BLEU`
    (e.g. tokenize="char"). `references`: one string per hypothesis, or one list of them each."""
    metric = _bleu_metric(**sacrebleu_options)
    score = metric.corpus_score(list(hypotheses), _refs_streams(hypotheses, references)).score
    return score, str(metric.get_signature())  # the signature needs a scored corpus (it counts references)


def bleu(hypotheses: Sequence[str], references: Sequence[str] | Sequence[Sequence[str]],
         **sacrebleu_options: Any) -> float:
    """Corpus BLEU (0-100), exactly `sacrebleu.corpus_bleu(hypotheses, [references]).score`."""
    return bleu_with_signature(hypotheses, references, **sacrebleu_options)[0]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator 1 - C(n-c, k) / C(n, k) (Chen et al. 2021) for n samples of
    which c pass, as a running product so that large n neither overflows nor loses precision."""
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise TypeError("n, c and k must be integers")
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"need n >= 1 and 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs at least k={k} samples per problem but n={n}: "
                         f"generate n >= {k} samples or ask for a smaller k")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


# --- problems ---------------------------------------------------------------------------------

HUMANEVAL_STOPS = ("\nclass ", "\ndef ", "\n#", "\nif __name__", "\nprint(")
MBPP_STOPS = ("\nassert ", "\nprint(", "\nif __name__", "\n```")


@dataclass
class CodeProblem:
    """One problem in a common form. `prompt` is what the model sees; the program that is run is
    `prefix` + the completion + `test` (HumanEval: the prefix is the prompt, which the completion
    continues; MBPP: the completion is a whole solution)."""

    task_id: str
    prompt: str
    prefix: str
    test: str
    canonical_solution: str
    entry_point: str = ""
    stops: tuple[str, ...] = ()

    def program(self, completion: str) -> str:
        return f"{self.prefix}{completion}\n\n{self.test}\n"

    def clean(self, completion: str) -> str:
        """Code from a raw model completion: a fenced block if there is one, else the text up to a stop."""
        if "```" in completion:
            return extract_code(completion)
        return truncate_at_stops(completion, self.stops)


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    if not path.is_file():
        raise FileNotFoundError(f"no data file at {path}")
    records = []
    with opener(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataFormatError(f"{path} line {i} is not JSON ({e}); expected one JSON object per "
                                          "line") from e
    return records


def _need(rec: dict, keys: tuple[str, ...], path: Path, what: str) -> None:
    missing = [k for k in keys if k not in rec]
    if missing:
        raise DataFormatError(f"{path}: a record lacks {missing}; is this a {what} file? "
                              f"Each line must be a JSON object with {', '.join(keys)}")


def load_humaneval(path: str | Path) -> list[CodeProblem]:
    """The HumanEval problems (HumanEval.jsonl[.gz] from openai/human-eval)."""
    path = Path(path)
    keys = ("task_id", "prompt", "canonical_solution", "test", "entry_point")
    out = []
    for r in _read_jsonl(path):
        _need(r, keys, path, "HumanEval")
        out.append(CodeProblem(str(r["task_id"]), r["prompt"], r["prompt"], f"{r['test']}\n\ncheck({r['entry_point']})",
                               r["canonical_solution"], r["entry_point"], HUMANEVAL_STOPS))
    return out


def mbpp_prompt(text: str, tests: Sequence[str]) -> str:
    """The MBPP prompt of Austin et al. (2021): the task and its tests."""
    return (f"You are an expert Python programmer, and here is your task: {text} "
            f"Your code should pass these tests:\n\n" + "\n".join(tests) + "\n")


def load_mbpp(path: str | Path, task_ids: Iterable[int] | None = range(11, 511)) -> list[CodeProblem]:
    """MBPP problems (mbpp.jsonl); by default the test split, task ids 11-510. None: all 974."""
    path = Path(path)
    wanted = None if task_ids is None else set(task_ids)
    out = []
    for r in _read_jsonl(path):
        _need(r, ("task_id", "text", "code", "test_list"), path, "MBPP")
        if wanted is not None and int(r["task_id"]) not in wanted:
            continue
        # The setup code builds test inputs from the solution's own classes (task 367: Node), so it
        # goes after the completion, before the asserts.
        setup = r.get("test_setup_code") or ""
        m = re.search(r"def\s+(\w+)\s*\(", r["code"])
        out.append(CodeProblem(f"MBPP/{r['task_id']}", mbpp_prompt(r["text"], r["test_list"]),
                               "", "\n".join(([setup] if setup.strip() else []) + list(r["test_list"])),
                               r["code"].replace("\r\n", "\n"), m.group(1) if m else "", MBPP_STOPS))
    if not out:
        raise DataFormatError(f"{path} holds no MBPP problems with the requested task ids")
    return out


# --- execution --------------------------------------------------------------------------------

# Runs inside the child: limits first, then the program as __main__, then a marker that only a
# program that ran to its end can leave (an early sys.exit(0) or os._exit(0) leaves none).
_LAUNCHER = """\
import os, resource, sys
def limit(which, soft, extra=0):
    hard = resource.getrlimit(which)[1]
    if hard != resource.RLIM_INFINITY:
        soft, extra = min(soft, hard), 0
    resource.setrlimit(which, (soft, soft + extra))
mem, cpu, fsize, marker = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
limit(resource.RLIMIT_AS, mem)
limit(resource.RLIMIT_CPU, cpu, 1)  # SIGXCPU at the soft limit (SIGKILL at the hard one would hide why)
limit(resource.RLIMIT_FSIZE, fsize)
limit(resource.RLIMIT_CORE, 0)
WORK = os.path.realpath(os.getcwd())
READ_ROOTS = tuple({os.path.realpath(p) for p in (WORK, sys.prefix, sys.base_prefix, sys.exec_prefix)}) + (
    "/dev/null", "/dev/urandom", "/proc/self/", "/usr/lib/", "/usr/share/zoneinfo/", "/etc/localtime")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
               "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"}
BLOCKED = {"socket.connect", "socket.bind", "socket.sendto", "socket.getaddrinfo", "subprocess.Popen", "os.system",
           "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "ctypes.dlopen", "ctypes.cdata",
           "os.kill", "os.killpg", "pty.spawn"}
def inside(path, roots):
    p = os.path.realpath(os.fsdecode(path))
    return any(p == r.rstrip("/") or p.startswith(r if r.endswith("/") else r + os.sep) for r in roots)
def guard(event, args):  # an audit hook: it cannot be removed once added
    if event == "open" and args[0] is not None and not isinstance(args[0], int):
        mode, flags = args[1] or "", args[2] or 0
        writing = any(c in mode for c in "wax+") or flags & WRITE_FLAGS
        if not inside(args[0], (WORK,) if writing else READ_ROOTS):
            raise PermissionError(f"sandbox: {'writing' if writing else 'reading'} {args[0]} is not allowed")
    elif event in PATH_EVENTS and any(isinstance(a, (str, bytes, os.PathLike)) and not inside(a, (WORK,))
                                      for a in args[:2]):
        raise PermissionError(f"sandbox: {event} outside the working folder is not allowed")
    elif event in BLOCKED or event.startswith("socket.") and event != "socket.__new__":
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.argv = ["solution.py"]
code = compile(open("solution.py", encoding="utf-8").read(), "solution.py", "exec")
sys.addaudithook(guard)
exec(code, {"__name__": "__main__", "__file__": "solution.py"})
with open(marker, "w") as f:
    f.write("done")
"""


@dataclass
class ExecResult:
    """status: passed, failed (an exception or a non-zero exit), timeout (wall clock), cpu_limit,
    out_of_memory, output_limit (wrote more than max_output_mb to a file or its output), exited_early
    (exit status 0 before the end of the tests), killed (another signal)."""

    status: str
    returncode: int | None
    duration_s: float
    stdout: str = ""
    stderr: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _tail(path: Path, n: int = 2000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-n:].decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=1)
def _no_network_prefix() -> tuple[str, ...]:
    """`unshare -rn` (a user and a network namespace: no network at all, no root needed) where the
    kernel allows it; nothing elsewhere (the launcher's audit hook still refuses sockets)."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    try:
        ok = subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return (exe, "-rn") if ok else ()


SANDBOX_NOTE = ("runs the code the model writes: each program in a throwaway folder with its own minimal "
                "environment, no network, writes confined to that folder, reads to it and Python's own files, "
                "no new processes, and limits on time, memory and output (docs/RELIABILITY.md)")


def run_program(program: str, timeout_s: float = 10.0, memory_mb: int = 2048, cpu_s: int | None = None,
                max_output_mb: int = 16) -> ExecResult:
    """Run a Python program in a fresh `python -I` process: its own temporary working directory, a
    minimal environment (no inherited variables, so no secrets), limits on address space
    (RLIMIT_AS), CPU time (RLIMIT_CPU, default the timeout + 1 s) and file size, its own process
    group killed at the end (children included), output to files rather than pipes (so a program
    that prints forever cannot fill this process's memory)."""
    if timeout_s <= 0 or memory_mb <= 0:
        raise ValueError("timeout_s and memory_mb must be positive")
    cpu_s = cpu_s if cpu_s is not None else int(math.ceil(timeout_s)) + 1
    with tempfile.TemporaryDirectory(prefix="tinygpt-exec-") as tmp:
        work = Path(tmp)
        (work / "solution.py").write_text(program, encoding="utf-8")
        (work / "launcher.py").write_text(_LAUNCHER, encoding="utf-8")
        marker = f".done-{uuid.uuid4().hex}"
        env = {"PATH": os.defpath, "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        args = [*_no_network_prefix(), sys.executable, "-I", "launcher.py", str(memory_mb * 2**20), str(cpu_s),
                str(max_output_mb * 2**20), marker]
        t0 = time.monotonic()
        with open(work / ".stdout", "wb") as out, open(work / ".stderr", "wb") as err:
            proc = subprocess.Popen(args, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True, close_fds=True)
            timed_out = False
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:  # the whole group: a child the program started dies with it
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                rc = proc.wait()
        duration = time.monotonic() - t0
        stdout, stderr = _tail(work / ".stdout"), _tail(work / ".stderr")
        finished = (work / marker).is_file()
        # Python ignores SIGXFSZ, so a write past the limit fails with EFBIG: tell it by the size.
        flooded = max((work / f).stat().st_size for f in (".stdout", ".stderr")) >= max_output_mb * 2**20
    if timed_out:
        status = "timeout"
    elif rc == 0:
        status = "passed" if finished else "exited_early"
    elif rc == -signal.SIGXCPU:
        status = "cpu_limit"
    elif flooded or rc == -signal.SIGXFSZ:
        status = "output_limit"
    elif rc < 0:
        status = "killed"
    elif "MemoryError" in stderr:
        status = "out_of_memory"
    else:
        status = "failed"
    return ExecResult(status, None if timed_out else rc, duration, stdout, stderr)


def check_completions(problems: Sequence[CodeProblem], completions: Sequence[str], workers: int | None = None,
                      **limits: Any) -> list[ExecResult]:
    """Run problems[i].program(completions[i]) for every i, `workers` processes at a time."""
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
    workers = workers or min(4, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:  # threads only wait on the processes
        return list(pool.map(lambda pc: run_program(pc[0].program(pc[1]), **limits), zip(problems, completions)))


def evaluate_code(problems: Sequence[CodeProblem], generate: Callable[[str], str], n: int = 1,
                  ks: Sequence[int] = (1,), workers: int | None = None, progress: bool = False,
                  **limits: Any) -> dict[str, Any]:
    """Generate `n` completions per problem with `generate(prompt) -> completion`, clean them
    (`CodeProblem.clean`), run them against the tests, and report pass@k for each k, syntax
    accuracy and BLEU against the canonical solutions, with the outcome of every problem."""
    for k in ks:
        pass_at_k(n, 0, k)  # raises now, before any generation, if k > n
    if not problems:
        raise ValueError("no problems to evaluate")
    flat_problems, flat_codes = [], []
    for p in _progress(problems, len(problems), "generating", progress):
        for _ in range(n):
            flat_problems.append(p)
            flat_codes.append(p.clean(generate(p.prompt)))
    results = check_completions(flat_problems, flat_codes, workers, **limits)
    per_problem, i = [], 0
    for p in problems:
        rs = results[i:i + n]
        per_problem.append({"task_id": p.task_id, "n": n, "passed": sum(r.passed for r in rs),
                            "statuses": [r.status for r in rs], "completions": flat_codes[i:i + n]})
        i += n
    out: dict[str, Any] = {"problems": len(problems), "n": n}
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(n, r["passed"], k) for r in per_problem) / len(per_problem)
    out["syntax_accuracy"] = syntax_accuracy([p.prefix + c for p, c in zip(flat_problems, flat_codes)])
    out["bleu"], out["bleu_signature"] = bleu_with_signature(flat_codes, [p.canonical_solution for p in flat_problems])
    out["per_problem"] = per_problem
    return out
