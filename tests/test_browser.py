"""The notebooks as a user sees them: headless Chromium on a local Jupyter server with Colab's ipywidgets 7.7.1
(tests/browser_colab.py), each notebook run all in smoke mode with the stand-in google.colab. The recipe
dropdown renders with its default, picking another recipe changes what the training cell trains, the live
loss plot is one picture that updates in place, and every notebook runs to the end without an error.

The screenshots are the README's: each is checked for what it must show (every recipe, one start-up table,
no red warning box, no None, tables inside their frame, a finetuning before/after that differs), and with
TINYGPT_SCREENSHOTS=docs/images they are copied there once every check has passed. The module takes about
10 minutes on 2 CPU cores, 1-2 of them for the finetuning notebook's base (browser_colab.SHOWCASE_BASE)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from browser_colab import ALL, missing_browser, run_in_browser
from test_notebooks import Colab

from tinygpt.core.recipes import RECIPES

pytestmark = [
    pytest.mark.slow,  # a browser and every notebook in it
    pytest.mark.skipif(missing_browser() is not None, reason=str(missing_browser())),
]


@pytest.fixture(scope="module")
def browser(tmp_path_factory, shared_data) -> tuple[dict, Path, Path]:
    """(observations by notebook, the screenshots' folder, the Colab stand-in's folder), all four notebooks run."""
    tmp = tmp_path_factory.mktemp("browser")
    env = Colab(tmp / "vm").env() | {"TINYGPT_SHARED_DATA": str(shared_data)}
    return run_in_browser(env, tmp / "images", ALL), tmp / "images", tmp / "vm"


def test_the_recipe_dropdown_renders_with_its_default_and_picks_what_trains(browser):
    seen, _, vm = browser
    nb = seen["01_pretrain.ipynb"]
    assert nb["default"].split()[0] == "cpu-smoke", nb[
        "default"
    ]  # TINYGPT_SMOKE's recipe, as Run all trains
    # every dropdown shows its choice, those whose value is None too ("the recipe's steps", "from scratch")
    assert nb["shown"][1:] == ["the recipe's steps", "auto (what the time buys)", "from scratch"], (
        nb["shown"]
    )
    assert {o.split()[0] for o in nb["options"]} >= {"cpu-smoke", "cpu", "a100-124m", "h100-760m"}
    runs = vm / "content" / "runs"
    assert (
        json.loads((runs / "my-first-gpt" / "run.json").read_text())["recipe"]["name"]
        == "cpu-smoke"
    )
    # the second run: a new RUN_NAME, the dropdown again at its default, then `cpu` picked before training
    assert nb["default_second"].split()[0] == "cpu-smoke" and nb["picked"].split()[0] == "cpu"
    assert json.loads((runs / "second-gpt" / "run.json").read_text())["recipe"]["name"] == "cpu"
    assert "no: a new run" in nb["train_second"]


def test_the_live_loss_plot_is_one_picture_that_updates_in_place(browser):
    nb = browser[0]["01_pretrain.ipynb"]
    assert nb["plot"]["most"] == 1, nb["plot"]  # never two stacked copies
    assert nb["plot"]["pictures"] >= 2, nb["plot"]  # redrawn while training, in the same place
    assert (
        nb["progress_bars"] >= 1
    )  # tqdm's widget bar renders with ipywidgets 7.7.1 while training
    assert (
        "training: 100%" in nb["train"]
    )  # and ends as its final state, the line a saved notebook keeps
    assert "def " in nb["samples"]


def test_every_notebook_runs_to_the_end_in_the_browser_with_tables_and_plots(browser):
    seen, images, _ = browser
    assert "cpu_cores" in seen["00_setup.ipynb"]["hardware"]
    assert all(
        name in seen["00_setup.ipynb"]["recipes"] for name in ("cpu-smoke", "a100-124m", "time")
    )
    assert "lora-r8" in seen["02_finetune.ipynb"]["recipe"]
    assert "step" in seen["02_finetune.ipynb"]["train"]
    assert (
        seen["03_evaluate.ipynb"]["curves"] == 1
        and "bits_per_byte" in seen["03_evaluate.ipynb"]["table"]
    )
    shots = sorted(p.name for p in images.glob("*.png"))
    assert shots == [
        "evaluate-runs.png",
        "evaluate-scores.png",
        "finetune.png",
        "pretrain-recipe-picker.png",
        "pretrain-training.png",
        "setup.png",
    ], shots
    for p in images.glob("*.png"):  # real pictures, not empty clips
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5_000, p.name


def _generations(text: str) -> list[tuple[str, str]]:
    """(before, after) answers from compare_generations' printed text."""
    pairs = re.findall(
        r"--- before \(the base\) ---\n(.*?)\n--- after \(with the adapter\) ---\n(.*?)(?=\n\n###|\Z)",
        text,
        re.S,
    )
    return [(b.strip(), a.strip()) for b, a in pairs]


def _product_text(text: str) -> str:
    """The page's text without what the models wrote (03_evaluate's `=== RUN` samples, 02_finetune's before/after
    answers): a model trained on Python writes `None` as readily as `def`, and which words a smoke model writes
    changes with torch's version (torch 2.11's sampling wrote one in 03_evaluate)."""
    text = re.sub(r"^=== .*?(?=^=== |^Out\[|^In \[|\Z)", "", text, flags=re.S | re.M)
    return re.sub(
        r"^--- (before|after) \(.*?\) ---\n.*?(?=^--- |^### |^Out\[|^In \[|\Z)",
        "",
        text,
        flags=re.S | re.M,
    )


def test_the_screenshots_show_todays_product_cleanly(browser):
    """What the README's pictures must show, checked on the page they were taken of."""
    seen, images, _ = browser
    for (
        name
    ) in ALL:  # no red box, no None, no unit that hides a real figure, no table cut by its frame
        nb = seen[name]
        assert nb["stderr"] == [], (name, nb["stderr"])
        assert nb["overflowing_tables"] == [], (name, nb["overflowing_tables"])
        assert not re.search(
            r"\bNone\b|\bnan\b|\b0\.0M\b|(?<![.\d])0 s\b", _product_text(nb["text"])
        ), (name, nb["text"][-3000:])
    setup, pretrain = seen["00_setup.ipynb"], seen["01_pretrain.ipynb"]
    assert all(
        name in setup["recipes"] for name in RECIPES
    )  # every recipe in the table and in the picker
    assert {o.split()[0] for o in pretrain["options"]} == set(RECIPES)
    assert pretrain["text"].count("to the first step") == 1  # the start-up said once, as its table
    assert "(autocast)" not in pretrain["text"]  # an fp32 run has no autocast weight copies
    if os.environ.get("TINYGPT_SCREENSHOTS"):
        out = Path(os.environ["TINYGPT_SCREENSHOTS"])
        out.mkdir(parents=True, exist_ok=True)
        for p in images.glob("*.png"):
            shutil.copyfile(p, out / p.name)


def test_the_finetuning_screenshot_shows_answers_that_changed(browser):
    """The base (browser_colab.SHOWCASE_BASE, a cpu-smoke model pretrained for 400 steps) answers an instruction
    with blank lines; after smoke mode's 6 steps the adapter makes it answer with Python: a change a reader sees."""
    pairs = _generations(browser[0]["02_finetune.ipynb"]["generations"])
    assert len(pairs) == 3 and sum(b != a for b, a in pairs) >= 2, (
        pairs
    )  # the adapter changed the answers
    for before, after in pairs:  # after: words, not one letter over and over
        assert len(set(after.replace(" ", ""))) > 3, pairs
