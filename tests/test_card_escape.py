"""A model card says what a user chose in words only (issue 32, item 10): a run folder named with a newline, a
heading and an `<img onerror>`, trained and evaluated on a file whose name holds a heading, a `javascript:` link
and HTML, exported with `tinygpt export` as a user types it. The card, rendered as CommonMark with tables (raw HTML
passed through, as a renderer that trusts the text would), has one title, tinygpt's own link only, and no HTML
from those names; each name is there as text, on its one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tinygpt.publish.card import CARD, CARD_TEXT_LIMIT, card_text

REPO = Path(__file__).resolve().parents[1]
EVIL_RUN = "evil\n# Owned\n<img src=x onerror=alert(1)>"
EVIL_DATA = "notes\n## Injected\n[click](javascript:alert(1)) <img src=y onerror=alert(2)>|x`y.txt"


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        ),
        "OMP_NUM_THREADS": "1",
        "TINYGPT_CACHE": str(cwd / "tg-cache"),
    }
    return subprocess.run(
        [sys.executable, "-m", "tinygpt", *map(str, args)],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )


def render(card: str) -> str:
    markdown_it = pytest.importorskip("markdown_it")
    body = card.split("\n---\n", 1)[1]  # the YAML front matter is the Hub's metadata, not markdown
    return markdown_it.MarkdownIt("commonmark").enable("table").render(body)


def test_names_with_markdown_html_and_links_are_text_in_the_exported_card(tmp_path, shakespeare):
    data = tmp_path / EVIL_DATA
    data.write_text(shakespeare[:100_000], encoding="utf-8")
    run = tmp_path / EVIL_RUN
    out = cli(
        "pretrain",
        "--recipe",
        "cpu-smoke",
        "--data",
        data,
        "--run-dir",
        run,
        "--max-steps",
        2,
        "--save-every",
        2,
        "--quiet",
        "--device",
        "cpu",
        "--probe",
        "off",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout
    out = cli(
        "eval",
        run,
        "--task",
        "perplexity",
        "--data",
        data,
        "--max-chars",
        2000,
        "--device",
        "cpu",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout
    out = cli("export", run, tmp_path / "export", cwd=tmp_path)
    assert out.returncode == 0, out.stdout
    card = (tmp_path / "export" / CARD).read_text(encoding="utf-8")
    html = render(card)

    assert html.count("<h1>") == 1 and re.findall(r"<h2>(.*?)</h2>", html) == [
        "Training",
        "Evaluations",
        "Use it",
    ]
    title = re.search(r"<h1>(.*?)</h1>", html).group(1)
    assert (
        title == "evil # Owned &lt;img src=x onerror=alert(1)&gt;"
    )  # the name, as text, on one line
    assert (
        "<img" not in html
        and "<script" not in html
        and "javascript:" not in "".join(re.findall(r'href="[^"]*"', html))
    )
    assert re.findall(r'<a href="([^"]*)"', html) == ["https://github.com/tinygpt/tinygpt"]
    # the data's name is one table cell, in the training table and in the evaluation's row
    flat = (
        "notes ## Injected [click](javascript:alert(1)) &lt;img src=y onerror=alert(2)&gt;|x`y.txt"
    )
    assert html.count(f"<code>{flat}</code>") == 2, html
    assert re.search(r"<td>perplexity</td>\s*<td><code>notes ## Injected", html)
    for line in card.splitlines():  # no line of the card starts with anything a name brought
        assert not line.startswith(("<", "[", "## Injected", "# Owned")), line


def test_card_text_keeps_every_string_on_one_inert_line():
    """The one escaping function, on the variants: backticks (a longer fence), a pipe (a table cell), Unicode line
    and paragraph separators, control characters, emphasis, entities, autolinks, and a long name (cut)."""
    assert card_text("a`b``c") == "```a`b``c```" and card_text("`x") == "`` `x ``"
    assert card_text("a|b") == "`a\\|b`" and card_text("") == ""
    assert card_text("a\u2028# b\u2029c\x00d\te\r\nf") == "`a # b c d e f`"
    assert card_text("_x_ *y* &amp; <b> https://e.com www.e.com", code=False) == (
        "\\_x\\_ \\*y\\* &amp;amp\\; &lt;b&gt; https\\:\\/\\/e\\.com www\\.e\\.com"
    )
    assert (
        card_text("bits_per_byte", code=False) == "bits_per_byte"
        and card_text("run-1", code=False) == "run-1"
    )
    assert len(card_text("x" * 1000, code=False)) == CARD_TEXT_LIMIT
    html = render(
        "---\n---\n" + card_text("[a](javascript:alert(1)) <img src=x onerror=1>\n# h", code=False)
    )
    assert "<a" not in html and "<img" not in html and "<h1>" not in html
