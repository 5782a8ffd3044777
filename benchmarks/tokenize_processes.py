"""GPT-2 tokenizing into shards as whole processes: tinygpt's shard writer against a plain tiktoken script.

    python benchmarks/tokenize_processes.py --repeat 5                     # the shared data's texts
    python benchmarks/tokenize_processes.py --text FILE [--text FILE ...]  # text the project never saw

Both sides are the process a user's machine runs, from launch to exit, imports included, on one text:

- tinygpt: `python -m tinygpt.data.shard_writer`, the background process `tinygpt pretrain` starts (its
  request on stdin, as `ShardWriter` sends it for GPT-2 on tiktoken): reads the text, cuts it into documents, encodes each batch
  of 256 with tiktoken, writes uint16 shards, their sha256 and the manifest.
- reference: a script of tiktoken and numpy alone: the same documents (cut by `tinygpt.data.sources`, pure
  Python), `encode_ordinary_batch` in batches of 256, each document's ids and end-of-text written as uint16
  to one file.

Run in turn (A B A B ...), one thread each (`RAYON_NUM_THREADS=1`, tiktoken's `num_threads=1`); each figure
is the child's CPU seconds (user + system, all threads, the kernel's accounting from `os.wait4`), and the
ratio is taken pair by pair. The table goes to a dated file in benchmarks/results/ (`--results`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("TINYGPT_SHARED_DATA", REPO.parent / "shared" / "data"))
TEXTS = ("tinyshakespeare.txt", "wikitext2_test.txt", "wikitext2_valid.txt")

_REFERENCE = r"""
import json, sys
import numpy as np
import tiktoken
from tinygpt.core.config import DataConfig
from tinygpt.data.sources import iter_documents

source, vocab_json, out = sys.argv[1:4]
kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
to_byte = {**{chr(b): b for b in kept}, **{chr(256 + n): b for n, b in enumerate(b for b in range(256) if b not in kept)}}
vocab = json.load(open(vocab_json, encoding="utf-8"))
ranks = {bytes(to_byte[c] for c in t): i for t, i in vocab.items() if t != "<|endoftext|>"}
pat = r"'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
enc = tiktoken.Encoding(name="gpt2", pat_str=pat, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256})
docs = list(iter_documents(DataConfig(source=source, tokenizer="gpt2", vocab_size=50304)))
with open(out, "wb") as f:
    for i in range(0, len(docs), 256):
        for ids in enc.encode_ordinary_batch(docs[i:i + 256], num_threads=1):
            ids.append(50256)
            np.asarray(ids, dtype=np.uint16).tofile(f)
"""


def child_cpu_s(cmd: list[str], stdin: bytes | None, env: dict) -> float:
    """CPU seconds (user + system, all threads) of one child process from launch to exit."""
    p = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    p.stdin.write(stdin or b"")
    p.stdin.close()
    err = p.stderr.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"{cmd[:3]} failed:\n{err.decode(errors='replace')[-3000:]}")
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--text", action="append", help="a text file (repeatable); default: the shared data's"
    )
    ap.add_argument("--repeat", type=int, default=5, help="pairs per text")
    results_file.add_option(ap)
    args = ap.parse_args()
    from tinygpt.core.config import DataConfig
    from tinygpt.model.tokenizer import find_gpt2_files, load_gpt2

    texts = (
        [Path(t) for t in args.text]
        if args.text
        else [SHARED / t for t in TEXTS if (SHARED / t).is_file()]
    )
    if not texts:
        raise SystemExit(
            "no text: give --text FILE, or TINYGPT_SHARED_DATA with the shared data sets"
        )
    tok, vocab_json = load_gpt2(), str(find_gpt2_files()[0])
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("RUST_BACKTRACE", None)
    print(
        f"# {time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.1f}, Python {platform.python_version()}, {args.repeat} pairs per text, "
        "CPU seconds of whole processes (user + system)"
    )
    say = results_file.Report()
    say(
        "| text | MB | tokens | tinygpt writer CPU-s | tiktoken script CPU-s | tinygpt speed / tiktoken's |"
    )
    say("|---|---|---|---|---|---|")
    for text in texts:
        ours, theirs = [], []
        tokens = 0
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as tmp:
                req = {
                    "data": DataConfig(
                        source=str(text), tokenizer="gpt2", vocab_size=50304
                    ).to_dict(),
                    "fingerprint": tok.fingerprint(),
                    "folder": tmp,
                    "shard_tokens": 1 << 21,
                    "parent": os.getpid(),
                    "max_shards": None,
                    "gpt2": True,
                }
                ours.append(
                    child_cpu_s(
                        [sys.executable, "-m", "tinygpt.data.shard_writer"],
                        json.dumps(req).encode(),
                        env,
                    )
                )
                manifest = json.loads((Path(tmp) / "manifest.json").read_text())
                tokens = manifest["train_tokens"] + manifest["val_tokens"]
                out = Path(tmp) / "ref.bin"
                theirs.append(
                    child_cpu_s(
                        [sys.executable, "-c", _REFERENCE, str(text), vocab_json, str(out)],
                        None,
                        env,
                    )
                )
                ref_tokens = out.stat().st_size // 2
        ratio = statistics.median(b / a for a, b in zip(ours, theirs))
        say(
            f"| {text.name} | {text.stat().st_size / 1e6:.2f} | {tokens:,} (reference {ref_tokens:,}) | "
            f"{statistics.median(ours):.2f} | {statistics.median(theirs):.2f} | **{ratio:.2f}x** |"
        )
    say("\ngoal: at least 0.8x")

    results_file.write(
        args.results,
        __file__,
        "tokenize-processes",
        "GPT-2 tokenizing into shards as whole processes: tinygpt's writer against a tiktoken script",
        say.text(),
        reference="a script of tiktoken and numpy alone writing the same ids (the tiktoken script column), "
        f"pairs per text {args.repeat}, the ratio taken pair by pair",
    )


if __name__ == "__main__":
    main()
