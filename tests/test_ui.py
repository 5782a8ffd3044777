"""Notebook pieces without a notebook: the recipe picker's default, the live loss plot (Agg), the
tables, run folders on (fake) Drive, and the zip that Colab downloads."""

from __future__ import annotations

import json
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tinygpt import colab
from tinygpt.colab import notebook
from tinygpt.core import units
from tinygpt.core.checkpoint import save_checkpoint, verify_checkpoint
from tinygpt.core.gpu_classes import HARDWARE
from tinygpt.core.recipes import RECIPES, get_recipe
from tinygpt.fit.hardware import hardware_report

FAKE_COLAB = Path(__file__).parent / "fake_colab"


@pytest.fixture(autouse=True)
def plain(monkeypatch, tmp_path):
    """Not in smoke mode, runs and caches under tmp, and no google.colab (a test adds the fake where it wants it)."""
    monkeypatch.delenv("TINYGPT_SMOKE", raising=False)
    monkeypatch.setenv("TINYGPT_WORKDIR", str(tmp_path / "content"))
    monkeypatch.setenv(
        "TINYGPT_CACHE", str(tmp_path / "cache")
    )  # the trial search caches its result there
    for name in [n for n in sys.modules if n == "google.colab" or n.startswith("google.colab.")]:
        monkeypatch.delitem(sys.modules, name)


@pytest.fixture(scope="module")
def report():
    return hardware_report("cpu")


def write_run_json(run_dir: Path, recipe: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text(json.dumps({"recipe": get_recipe(recipe).to_dict()}))


# ---- the recipe picker ---------------------------------------------------------------------------


def test_not_in_a_notebook_here():
    assert colab.in_notebook() is False


def test_picker_defaults_to_the_probes_choice(report):
    picker = colab.recipe_picker(report)
    assert (
        report.default_recipe == "cpu" and picker.value == "cpu" and picker.dropdown.value == "cpu"
    )
    assert [v for _, v in picker.dropdown.options] == list(RECIPES)
    gpu = replace(
        report, default_recipe="a100-124m", hardware_class="a100"
    )  # as the probe says on an A100
    assert colab.recipe_picker(gpu).value == "a100-124m"
    assert "probe's choice" in repr(colab.recipe_picker(gpu))


def test_picker_offers_a_time_budget_with_a_session_default(report, tmp_path, monkeypatch):
    assert colab.recipe_picker(report).hours is None  # a CPU trains the recipe's steps
    gpu = replace(report, hardware_class="a100", default_recipe="a100-124m")
    picker = colab.recipe_picker(gpu)
    assert picker.hours == HARDWARE["a100"].session_hours == 2.0 and "time: 2 h" in repr(picker)
    picker.hours_dropdown.value = 0.5  # the user picks half an hour
    assert picker.hours == 0.5
    from tinygpt.pretrain.run_pretrain import pretrain

    run = colab.run_folders("budgeted", tmp_path / "drive")
    pretrain(
        "cpu-smoke", run.local, hours=0.001, progress=False, device="cpu", cache_dir=tmp_path / "c"
    )
    assert (
        colab.recipe_picker(gpu, resume_from=run).hours == 0.001
    )  # a resumed run keeps its own budget
    assert "0.001 h" in [
        label for label, _ in colab.recipe_picker(gpu, resume_from=run).hours_dropdown.options
    ]
    monkeypatch.setenv("TINYGPT_SMOKE", "1")
    assert colab.recipe_picker(gpu).hours is None


def test_picker_default_follows_size_auto_as_the_cli_does_until_the_user_picks(report, tmp_path):
    from tinygpt.pretrain.init import default_recipe as cli_default

    picker = colab.recipe_picker(report)  # a CPU: the recipe's steps, so the probe's cpu
    assert picker.value == "cpu" and picker.size is None
    picker.hours_dropdown.value = 0.5  # a time, size auto: the ladder the CLI climbs here
    ladder, why = cli_default(tmp_path / "new", sized=True)
    assert picker.value == ladder == "cpu-fast" and "ladder" in picker.reason_line.value
    assert "Memory of cpu-fast" in picker.summary.value and "recipe: cpu-fast" in repr(picker)
    picker.size_dropdown.value = None  # the recipe's size: the probe's default again
    assert picker.value == "cpu" and "probe&#x27;s choice" in picker.reason_line.value
    picker.dropdown.value = "cpu-smoke"  # the user's pick is kept whatever the time and size
    picker.size_dropdown.value = "auto"
    picker.hours_dropdown.value = 1.0
    assert picker.value == "cpu-smoke" and picker.user_chose
    run = colab.run_folders("r", tmp_path / "MyDrive")
    write_run_json(run.mirror, "cpu")  # a resumed run keeps its recipe under size auto too
    resumed = colab.recipe_picker(report, resume_from=run)
    resumed.hours_dropdown.value = 0.5
    assert resumed.value == "cpu" and not resumed.user_chose


def test_picker_value_is_read_when_the_training_cell_runs(report):
    picker = colab.recipe_picker(report)
    picker.dropdown.value = "cpu-smoke"  # the user changes it after the cell ran
    assert picker.value == "cpu-smoke" and picker.default == "cpu"
    shown = picker.summary.value  # the HTML under the dropdown, redrawn on the change
    assert (
        "Memory of cpu-smoke" in shown
        and "Expected on this runtime" in shown
        and "cpu_cores" not in shown
    )
    assert (
        "Recipes on this runtime" in shown and "h100-760m" in shown
    )  # every recipe's memory and time


def test_picker_defaults_to_the_recipe_of_the_run_on_drive(report, tmp_path, monkeypatch):
    run = colab.run_folders("r", tmp_path / "MyDrive")
    write_run_json(run.mirror, "t4-50m")
    monkeypatch.setenv("TINYGPT_SMOKE", "1")  # the run being resumed wins even over smoke mode
    picker = colab.recipe_picker(report, resume_from=run)
    assert picker.value == "t4-50m" and "run on Drive" in picker.reason
    assert colab.recipe_picker(report, resume_from=run.mirror).value == "t4-50m"
    # Only the local copy (the same VM, Drive not synced yet) is enough too; an unknown recipe is ignored.
    write_run_json(run.local, "cpu")
    (run.mirror / "run.json").unlink()
    assert colab.recipe_picker(report, resume_from=run).value == "cpu"
    (run.local / "run.json").write_text(json.dumps({"recipe": {"name": "my-own"}}))
    assert colab.recipe_picker(report, resume_from=run).value == "cpu-smoke"


def test_smoke_mode(report, monkeypatch):
    assert colab.smoke_settings() == {}
    monkeypatch.setenv("TINYGPT_SMOKE", "1")
    assert colab.smoke_mode() and colab.recipe_picker(report).value == "cpu-smoke"
    assert colab.smoke_settings()["max_steps"] < get_recipe("cpu-smoke").train.max_steps
    monkeypatch.setenv("TINYGPT_SMOKE", "0")
    assert not colab.smoke_mode()


def test_without_ipywidgets_a_script_still_gets_the_default_and_a_notebook_is_told_how_to_install(
    report, monkeypatch
):
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import ipywidgets -> ImportError
    picker = colab.recipe_picker(report)
    assert picker.dropdown is None and picker.value == "cpu" and "recipe: cpu" in repr(picker)
    monkeypatch.setattr(
        notebook, "in_notebook", lambda: True
    )  # where the pickers ask for ipywidgets
    with pytest.raises(ImportError, match=r"pip install"):
        colab.recipe_picker(report)


# ---- the live loss plot --------------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def log(plot: colab.LossPlot, step: int, **extra) -> None:
    plot.on_log({"step": step, "loss": 6.0 - step / 10, "tokens": step * 512, "lr": 1e-3, **extra})


def test_loss_plot_draws_throttled_without_a_kernel_and_saves_with_the_run(tmp_path):
    import matplotlib

    matplotlib.use("Agg")

    clock = Clock()
    plot = colab.LossPlot(tmp_path, min_interval_s=2.0, clock=clock)
    assert plot.show is False and plot.enabled
    log(plot, 5)
    assert plot.draws == 1  # the first point at once
    for step in (10, 15):
        log(plot, step)
    plot.on_log({"step": 15, "val_loss": 5.0})  # an evaluation between two logs
    assert plot.draws == 1  # throttled
    clock.t = 2.5
    log(plot, 20, val_loss=4.5)
    assert plot.draws == 2
    ax = plot.figure.axes[0]
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()}
    assert lines["loss"] == ([5, 10, 15, 20], [5.5, 5.0, 4.5, 4.0])
    assert lines["val loss"] == ([15, 20], [5.0, 4.5])
    assert ax.child_axes[0].get_xlabel() == "tokens"  # the top axis
    plot.close()
    assert plot.draws == 3 and (tmp_path / "plots" / "loss.png").stat().st_size > 1000


def test_loss_plot_of_a_resumed_run_starts_with_the_curve_so_far(tmp_path):
    # The trainer cut metrics.jsonl at the resumed step (10) and appended step 15 before calling on_log.
    (tmp_path / "metrics.jsonl").write_text(
        "".join(
            json.dumps(m) + "\n"
            for m in [
                {"step": 5, "loss": 5.5},
                {"step": 10, "loss": 5.0, "val_loss": 5.1},
                {"step": 15, "loss": 4.5},
            ]
        )
    )
    plot = colab.LossPlot(tmp_path)
    plot.on_log({"step": 15, "loss": 4.5})
    assert [m["step"] for m in plot.history] == [5, 10, 15]


def test_loss_plot_is_a_trainer_callback(shared_data, tmp_path):
    from tinygpt.pretrain.run_pretrain import pretrain

    plot = colab.LossPlot(tmp_path / "run", min_interval_s=0.0)
    pretrain(
        "cpu-smoke",
        tmp_path / "run",
        data=str(shared_data / "tinyshakespeare.txt"),
        max_steps=10,
        eval_every=5,
        save_every=10,
        device="cpu",
        progress=False,
        callbacks=[plot],
        cache_dir=tmp_path / "c",
    )
    assert [m["step"] for m in plot.history if "loss" in m] == [5, 10]
    assert (
        plot.draws >= 3 and (tmp_path / "run" / "plots" / "loss.png").is_file()
    )  # close() drew the end
    record = next(
        m["startup"]
        for m in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        if "startup" in m
    )
    table = colab.startup_table(record)
    assert [r[0] for r in table.rows] == [
        "phase",
        "restore",
        "probe",
        "tokenizer",
        "model",
        "data",
        "first step",
        "to the first step",
    ]
    assert table.rows[-1][1] == f"{record['total_s']:.1f}" and "<table" in table._repr_html_()


def test_loss_plot_without_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    plot = colab.LossPlot()
    plot.on_log({"step": 1, "loss": 3.0})
    plot.close()
    assert not plot.enabled and plot.draws == 0  # a script: nothing to do
    with pytest.raises(ImportError, match=r"pip install"):
        colab.LossPlot(show=True)  # a notebook: say how to get it


# ---- plots never through links, and only what a plan may hold (issue 48) -------------------------

PNG = b"\x89PNG\r\n"


def planned_run(run_dir: Path, **change) -> Path:
    """A run folder whose run.json keeps a plan of three sizes (d4 chosen), with `change` applied to the
    plan (rows=...: the rows instead)."""
    rows = [
        {
            "size": f"d{d}",
            "params": 2e4 * d**3,
            "tokens": 4e6 / d,
            "tokens_per_s": 1e4,
            "predicted_loss": 5 - d / 4,
            "chosen": d == 4,
            "epochs": 0.5,
        }
        for d in (2, 4, 6)
    ]
    plan = {"size": "d4", "hours": 0.01, "candidates": change.pop("rows", rows), **change}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text(
        json.dumps({"recipe": get_recipe("cpu-smoke").to_dict(), "plan": plan})
    )
    return run_dir


def test_plots_replace_a_link_at_their_file_and_refuse_a_linked_folder(tmp_path):
    """plots/loss.png and plots/plan.png were written through a symbolic link (a user's file overwritten with a
    PNG) and into another folder through a linked plots/: now the file link is replaced by the PNG, never
    followed, a hard link is not written through, and a linked plots/ folder is refused in one line."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    from tinygpt.core.files import UnsafePathError

    victim = tmp_path / "users_file.txt"
    victim.write_bytes(b"keep me")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def loss_plot(run: Path) -> None:
        plot = colab.LossPlot(run)
        log(plot, 5)
        plot.close()

    for name, draw in (
        ("loss.png", loss_plot),
        ("plan.png", lambda run: colab.plan_plot(run, show=False)),
    ):
        for link in (os.symlink, os.link):
            run = planned_run(tmp_path / f"{name}-{link.__name__}")
            (run / "plots").mkdir()
            link(victim, run / "plots" / name)
            draw(run)
            assert victim.read_bytes() == b"keep me", (name, link)
            png = run / "plots" / name
            assert (
                not png.is_symlink()
                and png.stat().st_nlink == 1
                and png.read_bytes().startswith(PNG)
            )
            assert sorted(p.name for p in (run / "plots").iterdir()) == [
                name
            ]  # no temporary file left
        run = planned_run(tmp_path / f"{name}-folder")
        (run / "plots").symlink_to(elsewhere, target_is_directory=True)
        with pytest.raises(
            UnsafePathError, match=r"plots is a symbolic link .*elsewhere.*never follows"
        ) as e:
            draw(run)
        assert "\n" not in str(e.value) and list(elsewhere.iterdir()) == []
    assert victim.read_bytes() == b"keep me"


@pytest.mark.parametrize(
    "hostile,refusal",
    [
        (
            dict(
                rows=[
                    {
                        "size": "d2",
                        "params": 1e5,
                        "tokens": 1e6,
                        "tokens_per_s": 1e4,
                        "predicted_loss": 4.0,
                        "chosen": False,
                    }
                ]
            ),
            "marks 0 sizes as chosen",
        ),  # was StopIteration
        (
            dict(
                rows=[
                    {
                        "size": "d2",
                        "params": 1e308,
                        "tokens": 1e6,
                        "tokens_per_s": 1e4,
                        "predicted_loss": 4.0,
                        "chosen": True,
                    }
                ]
            ),
            r"gives size d2 params 1e\+308",
        ),  # was an arange error
        (
            dict(
                rows=[
                    {
                        "size": "d2",
                        "params": 1e5,
                        "tokens": 1e6,
                        "tokens_per_s": 1e4,
                        "predicted_loss": 1e200,
                        "chosen": True,
                    }
                ]
            ),
            r"predicted_loss 1e\+200",
        ),
        (
            dict(
                rows=[
                    {
                        "size": f"d{i}",
                        "params": 1e5 + i,
                        "tokens": 1e6,
                        "tokens_per_s": 1e4,
                        "predicted_loss": 4.0,
                        "chosen": i == 0,
                    }
                    for i in range(100_000)
                ]
            ),
            "has 100000 sizes",
        ),  # was 286 s
        (dict(hours=1e300), r"asks 1e\+300 hours"),
    ],
)
def test_plan_plot_refuses_a_plan_it_cannot_draw_in_one_line(tmp_path, hostile, refusal):
    from tinygpt.core.config import ConfigError

    run = planned_run(tmp_path / "r", **hostile)
    with pytest.raises(ConfigError, match=refusal) as e:
        colab.plan_plot(run, show=False)
    message = str(e.value)
    assert (
        message.startswith(f"{run / 'run.json'}'s plan ")
        and "\n" not in message
        and len(message) < 300
    )
    assert not (run / "plots").exists()  # refused before any work


def test_plan_plot_draws_labels_as_plain_text_of_bounded_length(tmp_path):
    """A size named in mathtext ($\\frac{...}$ nested: a RecursionError) or in 2M characters (245 s, 1.5 GB, a
    FreeType error) is drawn as its first characters, as written: no mathtext, no TeX."""
    import matplotlib

    matplotlib.use("Agg")
    nested = "$" + "\\frac{1}{" * 200 + "x" + "}" * 200 + "$"
    rows = [
        {
            "size": size,
            "params": 1e5 * (i + 1),
            "tokens": 1e6,
            "tokens_per_s": 1e4,
            "predicted_loss": 4.0 - i,
            "chosen": i == 0,
        }
        for i, size in enumerate([nested, "x" * 2_000_000, "d\x1b[2Jx"])
    ]
    fig = colab.plan_plot(planned_run(tmp_path / "r", rows=rows), show=False)
    labels = [t for t in fig.axes[0].texts]
    assert [t.get_text() for t in labels] == [nested[:23] + "…", "x" * 23 + "…", "d[2Jx"]
    assert all(not t.get_parse_math() and not t.get_usetex() for t in labels)
    legend = fig.axes[0].get_legend().get_texts()
    assert (
        legend[-1].get_text().startswith("chosen: " + nested[:23] + "…")
        and not legend[-1].get_parse_math()
    )
    assert (tmp_path / "r" / "plots" / "plan.png").read_bytes().startswith(PNG)


# ---- tables --------------------------------------------------------------------------------------


def test_summary_renders_hardware_memory_and_expectations(report):
    s = colab.summary("cpu", report)
    page = s._repr_html_()
    assert (
        page.count("<table") == 3
        and "AdamW" in page
        and "time to finish" in page
        and "cpu_cores" in page
    )
    assert "Memory of cpu" in str(s) and "tokens/s" in str(s)
    found = colab.trial_search("cpu-smoke", report, time_limit_s=5)
    with_search = colab.summary("cpu-smoke", report, found)
    assert "Trial search" in str(with_search) and "measured by trial" in str(with_search)
    assert colab.trial_search("a100-124m", report) is None  # a GPU recipe is not tried on a CPU


def test_recipes_table_lists_every_recipe_and_marks_the_default(report):
    t = colab.recipes_table(report)
    names = [row[0] for row in t.rows[1:]]
    assert len(names) == len(RECIPES) and f"{report.default_recipe} (default here)" in names
    assert "<th" in t._repr_html_() and "&lt;" not in colab.Table([("a<b",)])._repr_html_().replace(
        "a&lt;b", ""
    )
    by_name = {row[0].split()[0]: row for row in t.rows[1:]}
    assert (
        by_name["cpu-smoke"][4] == f"{get_recipe('cpu-smoke').token_budget / 1e3:.3g}k"
    )  # 15.4k, not 0.0M
    assert "0.0M" not in str(t) and " 0 s " not in str(t) + " "
    assert [units.count(n) for n in (512, 15_360, 614_400, 1.3e6, 5.2e9)] == [
        "512",
        "15.4k",
        "614k",
        "1.3M",
        "5.2B",
    ]
    assert [units.duration(s) for s in (None, 0.04, 0.4, 12, 600, 9000)] == [
        "-",
        "0.04 s",
        "0.4 s",
        "12 s",
        "10 min",
        "2.5 h",
    ]
    assert [units.size_gb(g) for g in (0.004, 0.3, 3.21)] == ["4.1 MB", "307 MB", "3.2 GB"]
    assert " 0.0 GB" not in str(t) and "0.00 h" not in str(colab.summary("cpu-smoke", report))
    fp32 = str(colab.summary("cpu", report, hardware=False))
    assert "(autocast)" not in fp32 and "none: fp32 matmuls use the master weights" in fp32


def test_result_table(tmp_path):
    from tinygpt.train.trainer import TrainResult

    r = TrainResult(
        tmp_path, 12, 5.6, 5.7, 5.65, tmp_path / "c", 9000.0, resumed_from=8, interrupted=True
    )
    text = str(colab.result_table(r))
    assert "from step 8" in text and "5.6000" in text and "run the training cell again" in text


# ---- Drive, run folders, the download ------------------------------------------------------------


def test_outside_colab_a_local_folder_stands_in_for_drive(tmp_path):
    mydrive = colab.connect_drive()
    assert mydrive == tmp_path / "content" / "drive" / "MyDrive" and mydrive.is_dir()
    run = colab.run_folders("my-run", mydrive)
    assert run.local == tmp_path / "content" / "runs" / "my-run"
    assert run.mirror == mydrive / "tinygpt" / "runs" / "my-run"
    assert "nothing on Drive yet" in str(run)
    for bad in ("", "a/b", ".hidden", " x"):
        with pytest.raises(ValueError, match="plain folder name"):
            colab.run_folders(bad, mydrive)


def test_in_colab_drive_is_mounted(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(FAKE_COLAB))
    monkeypatch.setenv("TINYGPT_FAKE_DRIVE_ROOT", str(tmp_path / "backing"))
    monkeypatch.delenv("TINYGPT_WORKDIR")
    assert colab.in_colab() and colab.workdir() == Path("/content")
    mydrive = colab.connect_drive(tmp_path / "content")
    assert (tmp_path / "content" / "drive").is_symlink() and mydrive.resolve() == (
        tmp_path / "backing" / "MyDrive"
    )


def make_run(run_dir: Path, steps: tuple[int, ...]) -> None:
    write_run_json(run_dir, "cpu-smoke")
    (run_dir / "tokenizer.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text('{"step": 4, "loss": 5.0}\n')
    for s in steps:
        save_checkpoint(
            run_dir / "checkpoints" / f"step_{s:06d}",
            {"w": torch.full((8, 8), float(s))},
            {"step": s},
        )


def test_zip_run_holds_what_a_user_keeps_and_on_request_the_resumable_checkpoint(tmp_path):
    run = tmp_path / "runs" / "r"
    make_run(run, (4, 8))
    (run / "checkpoints" / "step_000008" / "state.pt").write_bytes(
        b"cut short"
    )  # newest is corrupt
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        archive = colab.zip_run(run)
    assert archive == tmp_path / "runs" / "r.zip"
    with zipfile.ZipFile(archive) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "unzipped")
    assert {
        "r/run.json",
        "r/tokenizer.json",
        "r/metrics.jsonl",
        "r/checkpoints/step_000004/model.safetensors",
    } <= names
    assert not any("step_000008" in n for n in names)
    assert verify_checkpoint(tmp_path / "unzipped" / "r" / "checkpoints" / "step_000004")[0]
    assert "r/checkpoints/step_000004/state.pt" not in names  # the optimizer state stays on Drive
    with zipfile.ZipFile(colab.zip_run(run, tmp_path / "full.zip", resumable=True)) as z:
        assert "r/checkpoints/step_000004/state.pt" in z.namelist()
    with pytest.raises(FileNotFoundError, match="no valid checkpoint"):
        colab.zip_run(tmp_path / "empty")


def test_samples_take_a_prompt_that_suits_the_runs_data(tmp_path, shared_data):
    """Not `def ` for a model trained on prose: the opening words of one of its held-out documents."""
    from tinygpt.pretrain.run_pretrain import pretrain

    prose = tmp_path / "prose.txt"
    prose.write_text(
        (shared_data / "tinyshakespeare.txt").read_text(encoding="utf-8")[:200_000],
        encoding="utf-8",
    )
    run = tmp_path / "run"
    pretrain(
        "cpu-smoke",
        run,
        data=str(prose),
        max_steps=2,
        save_every=2,
        eval_every=2,
        progress=False,
        device="cpu",
        cache_dir=tmp_path / "cache",
    )
    prompt = colab.sample_prompt(run)
    assert prompt != "def " and prompt.split()[0] in prose.read_text()
    texts = colab.samples(run, n=2, max_new_tokens=5, device="cpu")
    assert len(texts) == 2 and all(t.startswith(prompt) for t in texts)


def test_a_notebook_shows_the_start_up_once(shared_data, tmp_path, capsys):
    """With the loss plot shown, its start-up table replaces the trainer's line; without it, the line stays."""
    from tinygpt.pretrain.run_pretrain import pretrain

    kw = dict(
        data=str(shared_data / "tinyshakespeare.txt"),
        max_steps=2,
        eval_every=2,
        save_every=2,
        device="cpu",
        progress=True,
        cache_dir=tmp_path / "c",
    )
    pretrain(
        "cpu-smoke",
        tmp_path / "shown",
        callbacks=[colab.LossPlot(tmp_path / "shown", show=True)],
        **kw,
    )
    out = capsys.readouterr()
    assert (out.out + out.err).count(
        "to the first step"
    ) == 1 and "s to the first step:" not in out.out  # the table
    pretrain(
        "cpu-smoke",
        tmp_path / "plain",
        callbacks=[colab.LossPlot(tmp_path / "plain", show=False)],
        **kw,
    )
    out = capsys.readouterr()
    assert (out.out + out.err).count(
        "to the first step"
    ) == 1 and "s to the first step:" in out.out + out.err  # the line
