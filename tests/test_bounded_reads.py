"""One bad file never blocks a start with a line naming nothing, and no file is read whole that may be huge
(issue 32, items 5 and 6; docs/RELIABILITY.md).

Each attack is built for real: a step folder named with a superscript digit, a 5000-digit sample heading, a
metrics row whose step is a string, a safetensors header that lies (its manifest rewritten to match), binary
and deeply nested data files, a 10 GB sparse `--data` file, a 2 MB gzip of one 1 GB line. Memory is measured
in a subprocess (resource.getrusage, with an address-space limit so that old code fails fast instead of taking
gigabytes): the test process itself never holds more than a few MB of any of them.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tinygpt.cli import main
from tinygpt.core import checkpoint as ckpt
from tinygpt.core import datafiles
from tinygpt.core.checkpoint import CheckpointError
from tinygpt.core.rundir import RunDir, RunDirError
from tinygpt.data.sources import DataError
from tinygpt.finetune.records import load_records, record_segments
from tinygpt.pretrain.run_pretrain import pretrain

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(max_steps=4, save_every=2, eval_every=2, progress=False, device="cpu")
GB = 1 << 30


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    """A real cpu-smoke run on the built-in corpus: 4 steps, checkpoints at 2 and 4."""
    run = tmp_path_factory.mktemp("runs") / "r"
    pretrain("cpu-smoke", run, cache_dir=run.parent / "cache", **FAST)
    return run


def _copy(small_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    return run


def _bounded(
    tmp_path: Path, body: str, address_space: int | None = None, timeout: int = 300
) -> dict:
    """Run `body` (Python) in a fresh interpreter whose address space is capped (old code that reads a huge file
    whole fails at once with MemoryError rather than taking gigabytes of this machine), and return `out` as
    the body left it, with its peak resident memory in MB (the larger of its own and its children's).
    address_space None: 2.4 GB above what importing torch maps (3 GB in all with torch's CPU build, which maps
    0.65 GB; its CUDA build, Colab's, maps 3 GB of libraries without touching them)."""
    script = tmp_path / "bounded.py"
    cap = (
        [f"cap = {address_space}"]
        if address_space is not None
        else [
            "import torch  # noqa: F401",
            "mapped = next(int(ln.split()[1]) for ln in open('/proc/self/status') if ln.startswith('VmSize:'))",
            f"cap = mapped * 1024 + {2400 << 20}",
        ]
    )
    script.write_text(
        "\n".join(
            [
                "import json, resource",
                *cap,
                "resource.setrlimit(resource.RLIMIT_AS, (cap, cap))",
                "out = {}",
                "try:",
                textwrap.indent(textwrap.dedent(body).strip(), "    "),
                "finally:",
                # this process's own peak from VmHWM: its ru_maxrss keeps the peak of the process it was started from
                # (Linux carries it across exec), here a pytest worker holding torch
                "    own = next(int(ln.split()[1]) for ln in open('/proc/self/status') if ln.startswith('VmHWM:'))",
                "    rss = max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)",
                "    out['maxrss_mb'] = rss / 1024",
                # bytes this process read through read(2) and its kind (a count, not a size of the machine's libraries)
                "    rchar = next(int(ln.split()[1]) for ln in open('/proc/self/io') if ln.startswith('rchar:'))",
                "    out['read_mb'] = rchar / 2**20",
                "    print(json.dumps(out))",
            ]
        )
        + "\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=tmp_path,
    )
    assert p.stdout.strip(), p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["stderr"] = p.stderr
    return res


def _error_line(err: str, command: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith(f"tinygpt {command}: error:")]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return lines[0]


def _gzip_of(path: Path, block: bytes, times: int, tail: bytes = b"") -> Path:
    """`block` * `times` + `tail`, gzipped as many copies of one small member (a valid gzip file: members
    concatenate): a file of a few MB that decompresses to gigabytes, made without compressing them."""
    member = gzip.compress(block, compresslevel=9)
    with open(path, "wb") as f:
        for _ in range(times):
            f.write(member)
        if tail:
            f.write(gzip.compress(tail))
    return path


# --- item 5: one bad file, named ----------------------------------------------------------------


def test_a_step_folder_or_sample_heading_that_is_no_step_blocks_nothing(
    small_run, tmp_path, capsys
):
    """`checkpoints/step_²` (str.isdigit takes '²', int refuses it), a step of 5000 digits (over Python's 4300
    for int()), and the same in samples.txt headings: each stopped every start; now they are no step names."""
    run = _copy(small_run, tmp_path)
    (run / "checkpoints" / "step_²").mkdir()
    (run / "checkpoints" / ("step_" + "9" * 200)).mkdir()
    with open(run / "samples.txt", "a", encoding="utf-8") as f:
        f.write("=== step " + "9" * 5000 + " ===\nx\n\n=== step ٣ ===\ny\n\n")
    assert (
        ckpt.step_of(run / "checkpoints" / "step_²") is None and ckpt.step_of("step_000020") == 20
    )
    # the CLI says a warning as one "tinygpt: warning:" line (issue 38), not Python's UserWarning print
    code_ = main(
        [
            "pretrain",
            "--recipe",
            "cpu-smoke",
            "--run-dir",
            str(run),
            "--max-steps",
            "6",
            "--quiet",
            "--device",
            "cpu",
        ]
    )
    out, err = capsys.readouterr()
    assert code_ == 0, err
    assert re.search(r"tinygpt: warning: .*step_² is not a checkpoint's name", err), err
    assert out.splitlines()[0] == "resumed from step 4"
    assert ckpt.verify_checkpoint(run / "checkpoints" / ckpt.step_name(6))[0]
    code_ = main(
        ["eval", str(run), "--task", "perplexity", "--max-chars", "2000", "--device", "cpu"]
    )
    out, err = capsys.readouterr()
    assert code_ == 0 and "step_000006" in out, (
        err
    )  # (the same warning again is shown once per process)


@pytest.mark.parametrize(
    "row, why",
    [
        ({"step": "x"}, "has step 'x'"),
        ({"step": 10**13, "loss": 1.0}, "has step '10000000000000'"),
        ({"step": True, "loss": 1.0}, "has step 'True'"),
        ({"step": 3, "loss": "low"}, "has 'loss' 'low', not a number"),
        ({"step": 3, "startup": [1]}, "has 'startup'"),
    ],
)
def test_a_bad_metrics_row_is_named_with_its_file_and_line(small_run, tmp_path, row, why):
    run = _copy(small_run, tmp_path)
    n = len((run / "metrics.jsonl").read_text().splitlines())
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n" + json.dumps({"step": 4, "loss": 1.0}) + "\n")
    with pytest.raises(RunDirError, match=rf"metrics.jsonl line {n + 1} {why}") as e:
        RunDir(run).metrics()
    assert str(run / "metrics.jsonl") in str(e.value) and "\n" not in str(e.value)


def test_a_bad_metrics_row_stops_a_start_in_one_line_naming_it(small_run, tmp_path, capsys):
    """`{"step": "x"}` said only "'<=' not supported between instances of 'str' and 'int'"."""
    run = _copy(small_run, tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": "x"}\n{"step": 4, "loss": 1.0}\n')
    assert (
        main(
            [
                "pretrain",
                "--recipe",
                "cpu-smoke",
                "--run-dir",
                str(run),
                "--max-steps",
                "6",
                "--quiet",
                "--device",
                "cpu",
            ]
        )
        == 2
    )
    line = _error_line(capsys.readouterr().err, "pretrain")
    assert str(run / "metrics.jsonl") in line and "line" in line and "has step 'x'" in line, line


def _lie_in_header(folder: Path, header: bytes | None) -> None:
    """Replace model.safetensors' header (None: keep it, but point a tensor past the file's end) and rewrite the
    manifest to match, as anyone who can write a shared folder can."""
    f = folder / ckpt.MODEL_FILE
    raw = f.read_bytes()
    if header is None:
        n = struct.unpack("<Q", raw[:8])[0]
        h = json.loads(raw[8 : 8 + n])
        name = next(k for k in h if k != "__metadata__")
        h[name]["data_offsets"] = [0, 10**12]
        hb = json.dumps(h).encode()
        f.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n :])
    else:
        f.write_bytes(header)
    manifest = ckpt.read_manifest(folder)
    ckpt.write_manifest(
        folder, {k: v for k, v in manifest.items() if k not in ("files", "format", "created_at")}
    )


def test_a_lying_safetensors_header_is_named_and_the_previous_checkpoint_used(
    small_run, tmp_path, capsys
):
    """The safetensors library's errors ("header too large", "invalid JSON in header") named no file."""
    run = _copy(small_run, tmp_path)
    newest = run / "checkpoints" / ckpt.step_name(4)
    good = (newest / ckpt.MODEL_FILE).read_bytes()
    _lie_in_header(newest, struct.pack("<Q", 1 << 40) + b"{}")
    code_ = main(
        ["eval", str(run), "--task", "perplexity", "--max-chars", "2000", "--device", "cpu"]
    )
    out, err = capsys.readouterr()
    assert code_ == 0 and "step_000002" in out, err
    assert re.search(
        r"tinygpt: warning: .*step_000004/model.safetensors is not a safetensors file: it says "
        r"its header is 1,099,511,627,776 bytes",
        err,
    ), err
    for header, said in [
        (struct.pack("<Q", 5) + b"hello", "a header that is not JSON"),
        (struct.pack("<Q", 100) + b"{}", "past the file's end"),
        (b"\x01\x02", "fewer than a safetensors header's 8"),
        (None, "whose bytes are not inside the file"),
    ]:
        (newest / ckpt.MODEL_FILE).write_bytes(good)
        _lie_in_header(newest, header)
        ok, why = ckpt.verify_checkpoint(newest)
        assert not ok and str(newest / ckpt.MODEL_FILE) in why and said in why, why
        with pytest.raises(CheckpointError, match=said) as e:
            ckpt.load_checkpoint(newest, verify=False)
        assert str(newest / ckpt.MODEL_FILE) in str(e.value)


def test_a_huge_or_deeply_nested_manifest_is_refused_naming_it(small_run, tmp_path):
    run = _copy(small_run, tmp_path)
    folder = run / "checkpoints" / ckpt.step_name(4)
    with open(folder / ckpt.MANIFEST, "r+b") as f:
        f.truncate(
            ckpt.MANIFEST_LIMIT + 1
        )  # what the old code read whole: a larger one is no different
    ok, why = ckpt.verify_checkpoint(folder)
    assert not ok and str(folder / ckpt.MANIFEST) in why and "more than" in why, why
    (folder / ckpt.MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    ok, why = ckpt.verify_checkpoint(folder)
    assert not ok and str(folder / ckpt.MANIFEST) in why, why
    with pytest.raises(CheckpointError, match="nests JSON too deep"):
        ckpt.read_manifest(folder)


def test_finetune_data_errors_name_the_file_and_the_line(tmp_path):
    """A binary file, JSON nested past the parser's depth and a record whose field is an object were reported
    as a UnicodeDecodeError, a RecursionError and "record 2: field 'instruction' must be text": no file named."""
    good = json.dumps({"instruction": "a", "output": "b"})
    cases = [
        (
            "binary.jsonl",
            (good + "\n").encode() + b"\x89PNG\r\n\x1a\n\xff\xfe\n",
            "line 2 is not UTF-8 text",
        ),
        ("binary.json", b"\x89PNG\r\n\x1a\n\xff\xfe\x00", "is not UTF-8 text"),
        ("deep.json", b"[" * 100_000 + b"]" * 100_000, "nests JSON too deep"),
        (
            "deep.jsonl",
            (good + "\n\n" + "[" * 100_000 + "]" * 100_000 + "\n").encode(),
            "line 3 nests too deep",
        ),
        (
            "nested.jsonl",
            (
                good
                + "\n"
                + good
                + "\n\n"
                + json.dumps({"instruction": {"x": 1}, "output": "y"})
                + "\n"
            ).encode(),
            r"line 4: record 2: field 'instruction' must be text, got dict",
        ),
        (
            "nested.json",
            json.dumps([json.loads(good), {"instruction": "c", "output": ["x"]}]).encode(),
            r"record 1: field 'output' must be text, got list",
        ),
        (
            "chat.jsonl",
            (
                json.dumps(
                    {
                        "messages": [
                            {"role": {"x": 1}, "content": "a"},
                            {"role": "assistant", "content": "b"},
                        ]
                    }
                )
                + "\n"
            ).encode(),
            r"line 1: record 0: message 0's role and content must be text",
        ),
    ]
    for name, data, said in cases:
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(DataError, match=said) as e:
            record_segments(load_records(str(path)))
        assert str(path) in str(e.value) and "\n" not in str(e.value), (name, str(e.value))


def test_code_eval_data_errors_name_the_file_and_the_line(tmp_path):
    """HumanEval / MBPP data (`read_jsonl`): a binary line, a damaged gzip, nesting past the parser's depth, a
    line that is a list: each named no file, or was taken as a record."""
    good = json.dumps({"task_id": "x"}) + "\n"
    cases = [
        (
            "binary.jsonl.gz",
            gzip.compress(good.encode() + b"\xff\xfe\n"),
            "line 2 is not UTF-8 text",
        ),
        ("notgzip.jsonl.gz", b"this is not gzip", "could not be read after line 0"),
        (
            "cut.jsonl.gz",
            gzip.compress(
                "".join(json.dumps({"task_id": f"{i**3}"}) + "\n" for i in range(5000)).encode()
            )[:5000],
            "could not be read after line",
        ),
        (
            "deep.jsonl",
            (good + "[" * 100_000 + "]" * 100_000 + "\n").encode(),
            "line 2 nests JSON too deep",
        ),
        ("list.jsonl", (good + "[1, 2]\n").encode(), "line 2 is a JSON list, not an object"),
    ]
    for name, data, said in cases:
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(datafiles.DataFormatError, match=said) as e:
            datafiles.read_jsonl(path)
        assert str(path) in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
    assert (
        datafiles.read_jsonl(_gzip_of(tmp_path / "ok.jsonl.gz", good.encode(), 3))
        == [{"task_id": "x"}] * 3
    )


# --- item 6: bounded reads -------------------------------------------------------------------------


def test_a_2mb_gzip_of_one_1gb_line_is_refused_in_bounded_memory(small_run, tmp_path):
    """`eval --data` of a small archive of one huge line held the whole line (4.5 GB resident for 2 GB) before
    saying "not JSON"; now the line is refused past 16 MB, naming the file and the line."""
    bomb = _gzip_of(tmp_path / "bomb.jsonl.gz", b"a" * (1 << 20), 1024, b"\n")  # 1 GB of one line
    assert bomb.stat().st_size < 4 << 20
    res = _bounded(
        tmp_path,
        f"""
        from tinygpt.cli import main
        out["rc"] = main(["eval", {str(small_run)!r}, "--task", "hellaswag", "--data", {str(bomb)!r},
                          "--device", "cpu"])
    """,
    )
    assert res["rc"] == 2, res["stderr"][-3000:]
    line = _error_line(res["stderr"], "eval")
    assert str(bomb) in line and "line 1 is longer than 16,777,216 characters" in line, line
    assert res["maxrss_mb"] < 800, res[
        "maxrss_mb"
    ]  # the CLI with torch is ~350 MB; the line alone is 1 GB


def test_an_eval_text_is_read_only_as_far_as_it_is_scored(small_run, tmp_path):
    """`eval --task perplexity --data` read a whole file (or archive) before cutting it to --max-chars' size;
    a 2 MB archive of 2 GB of text is now read 2000 characters far, and without --max-chars refused past 64M
    characters in one line that names the file and says what to do."""
    bomb = _gzip_of(
        tmp_path / "bomb.txt.gz", b"the quick brown fox jumps over the lazy dog\n" * 24_000, 2048
    )
    assert bomb.stat().st_size < 8 << 20
    res = _bounded(
        tmp_path,
        f"""
        from tinygpt.cli import main
        out["rc"] = main(["eval", {str(small_run)!r}, "--task", "perplexity", "--data", {str(bomb)!r},
                          "--device", "cpu"])
    """,
    )
    assert res["rc"] == 2, res["stderr"][-3000:]
    line = _error_line(res["stderr"], "eval")
    assert str(bomb) in line and "--max-chars" in line, line
    assert res["maxrss_mb"] < 1000, res["maxrss_mb"]  # ~350 MB and the 64M characters it stopped at
    res = _bounded(
        tmp_path,
        f"""
        from tinygpt.cli import main
        out["rc"] = main(["eval", {str(small_run)!r}, "--task", "perplexity", "--data", {str(bomb)!r},
                          "--max-chars", "2000", "--device", "cpu"])
    """,
    )
    assert res["rc"] == 0 and res["maxrss_mb"] < 800, (res["maxrss_mb"], res["stderr"][-3000:])


def test_a_10gb_sparse_data_file_is_skipped_without_being_read(tmp_path):
    """`pretrain --data` of a 10 GB sparse file was OOM-killed at 6.4 GB with no message: it was read whole
    before its NUL bytes were looked at. Now its first 8 KB say binary: nothing else is read."""
    sparse = tmp_path / "sparse.txt"
    with open(sparse, "wb") as f:
        f.truncate(10 * GB)
    res = _bounded(
        tmp_path,
        f"""
        from tinygpt.cli import main
        out["rc"] = main(["pretrain", "--recipe", "cpu-smoke", "--run-dir", "run", "--data", {str(sparse)!r},
                          "--max-steps", "2", "--quiet", "--device", "cpu"])
    """,
    )
    assert res["rc"] == 2, res["stderr"][-3000:]
    line = _error_line(res["stderr"], "pretrain")
    assert str(sparse) in line and "is a binary file (it has NUL bytes)" in line, line
    assert (
        "skipped" not in res["stderr"] and "Warning" not in res["stderr"]
    )  # said once, in the error
    # counted, not sized: the peak memory of the CLI with torch differs by 200 MB between environments (620 MB
    # locally, 830 MB in CI's Colab suite with bitsandbytes); the bytes it read are the claim
    assert res["read_mb"] < 512, res[
        "read_mb"
    ]  # imports read ~100 MB of sources; the file is 10 GB


def test_a_huge_text_file_is_read_only_as_far_as_max_chars_and_cut_as_before(tmp_path):
    """A 10 GB file of text (sparse: text, then NUL bytes past the first 8 KB, as the old reader took them):
    the documents of its first max_chars characters come out as they did when the file was read whole, the
    reading stops there. (No torch in that process: the address space is capped at 1 GB.)"""
    from tinygpt.data.sources import CHUNK_CHARS, _chunks

    text = "".join(
        f"line {i}: " + "word " * (i % 97) + ("\n" if i % 5 else " ") for i in range(20_000)
    )
    text += "x" * 50_000 + "é€ " * 30_000  # one long line, and characters of 2 and 3 bytes
    head = text.encode("utf-8")
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.write(head)
        f.truncate(10 * GB)
    max_chars = (
        len(text) - 1_000
    )  # the budget ends inside the text, its look-ahead reaches the NUL bytes
    whole = text + "\0" * (
        8 * CHUNK_CHARS
    )  # what the old reader cut: the text and (part of) the NULs
    expected, budget = [], max_chars
    for piece in _chunks(whole):
        if budget <= 0:
            break
        piece = piece[:budget]
        budget -= len(piece)
        expected.append(piece)
    res = _bounded(
        tmp_path,
        f"""
        from tinygpt.core.config import DataConfig
        from tinygpt.data.sources import iter_documents
        out["docs"] = list(iter_documents(DataConfig(source={str(big)!r}, max_chars={max_chars})))
    """,
        address_space=GB,
    )
    assert "docs" in res, res["stderr"][-3000:]
    assert res["docs"] == expected
    assert res["maxrss_mb"] < 200, res["maxrss_mb"]  # ~40 MB of Python and numpy, ~10 MB of text
