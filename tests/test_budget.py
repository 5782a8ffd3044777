"""A time budget (`--hours`): the warmup-stable-decay schedule, the step count measured and kept in
budget.json, fixed again at each checkpoint of the stable phase from the steps' mean time, a resume that
keeps it, and more hours for a run still in its stable phase.

No assertion on how long anything took (timings are for benchmarks/): step counts, learning rates
and files are checked."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import INVALID

from tinygpt.cli import main
from tinygpt.core.callback import Callback
from tinygpt.core.config import ConfigError, TrainConfig
from tinygpt.pretrain.pretrain_options import PretrainOptions
from tinygpt.pretrain.run_pretrain import pretrain
from tinygpt.train.budget import (
    Budget,
    decay_start,
    expected_final_loss,
    extend,
    least_stable_steps,
    refix,
    steps_for,
)
from tinygpt.train.step import lr_at

REPO = Path(__file__).resolve().parents[1]


def test_wsd_holds_the_rate_then_decays_to_min_lr_at_the_last_step():
    cfg = TrainConfig(
        schedule="wsd", max_steps=100, warmup_steps=10, lr=1e-3, min_lr=1e-4, decay_fraction=0.2
    )
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[9] == lrs[10] == lrs[79] == 1e-3 and lr_at(0, cfg) == pytest.approx(1e-4)
    assert decay_start(100, 0.2) == 80 and lrs[80] == 1e-3 > lrs[81] > lrs[98] > lrs[99]
    assert lrs[99] == pytest.approx(1e-4)  # the last step's rate is the schedule's final value
    longer = TrainConfig(**{**cfg.to_dict(), "max_steps": 10_000})
    assert [lr_at(s, longer) for s in range(80)] == lrs[
        :80
    ]  # until the decay, the count does not matter
    with pytest.raises(ConfigError, match="schedule"):
        TrainConfig(schedule=INVALID)


def test_steps_fit_the_hours_and_more_hours_extend_only_the_stable_phase():
    # 1 h, 600 s gone at step 100, 2 s a step, 10 s for the end: (3600 - 610) / 2 = 1495 more
    assert steps_for(1.0, 600, 100, 2.0, 10) == 1595
    assert steps_for(0.1, 600, 100, 2.0, 10) == 101  # over budget already: stop at the next step
    b = Budget(hours=1.0, max_steps=1595, decided_at_step=100, step_s=2.0, decided_at=0.0)
    more, note = extend(b, 2.0, 500, decay_fraction=0.2)
    assert more.max_steps == 1595 + 1800 and more.hours == 2.0 and "1595 -> 3395" in note
    same, note = extend(b, 2.0, 1400, decay_fraction=0.2)  # the decay began at step 1276
    assert same is b and "began its decay at step 1276" in note


def test_a_budget_fixed_again_follows_the_mean_step_time_but_never_jumps_into_the_decay():
    b = Budget(hours=1.0, max_steps=1595, decided_at_step=100, step_s=2.0, decided_at=0.0)
    # at step 500, 1,500 s gone (3 s a step on average, not 2): (3600 - 1510) / 3 = 696 more
    slower = refix(b, 500, 1500, 3.0, 10, decay_fraction=0.2, now=1.0)
    assert (slower.max_steps, slower.decided_at_step, slower.step_s) == (1196, 500, 3.0)
    faster = refix(b, 500, 500, 1.0, 10, decay_fraction=0.2, now=1.0)
    assert faster.max_steps == 500 + 3090 and faster.out_of_bounds() is None
    # at step 1200 with 90 s left the hours buy 31 steps, but a count that ends at 1231 began its decay
    # at step 985: the rate would jump down. The decay begins at the next step instead (1501: decay at 1201)
    late = refix(b, 1200, 3500, 2.9, 10, decay_fraction=0.2, now=1.0)
    assert (
        late.max_steps == 1501 and decay_start(1501, 0.2) == 1201 and late.out_of_bounds() is None
    )
    assert (
        refix(b, 1300, 3500, 2.9, 10, decay_fraction=0.2, now=1.0) is b
    )  # the decay began at 1276
    for f in (0.1, 0.2, 0.4):
        for step in range(0, 5000, 37):
            n = least_stable_steps(step, f)
            assert decay_start(n, f) > step >= decay_start(n - 1, f)
    whole = Budget(hours=1.0, max_steps=1595, decided_at_step=100, step_s=2.0, decided_at=0.0)
    assert (
        refix(whole, 500, 1500, 3.0, 10, decay_fraction=1.0, now=1.0) is whole
    )  # all decay: nothing to fix


class SlowAfterTheBudget(Callback):
    """After the budget first fixes the step count, each step takes `factor` times longer than the step
    time it measured (as a machine that another job starts on would); every message is kept."""

    def __init__(self, factor: float):
        self.factor, self.first = factor, None
        self.said: list[str] = []

    def on_step(self, trainer):
        if self.first is None and trainer.step_s:
            self.first = (trainer.max_steps, trainer.step_s)
        elif self.first is not None:
            time.sleep(self.factor * self.first[1])

    def on_message(self, text):
        self.said.append(text)


@pytest.mark.slow  # a 7-second budgeted run slowed down (short form: the re-fix test above)
def test_a_budgeted_run_that_slows_down_trains_the_count_it_fixed_with_its_schedule_whole(tmp_path):
    """Steps slow down once the budget has fixed the count (another job on the machine). Nothing here depends on
    how fast the machine is (how far the count falls is refix's arithmetic, checked above on given times): the run
    trains exactly the count in budget.json, each count it says it fixed again follows the one said before, and
    the schedule ends whole: the peak rate until the final count's decay began, then down to min_lr at its last
    step."""
    slow = SlowAfterTheBudget(3.0)
    res = pretrain(
        "cpu-smoke",
        tmp_path / "run",
        hours=0.002,
        device="cpu",
        progress=False,
        cache_dir=tmp_path / "c",
        callbacks=[slow],
    )
    budget = json.loads((tmp_path / "run" / "budget.json").read_text())
    decided, _ = slow.first
    assert res.step == budget["max_steps"]
    said = [
        tuple(map(int, m.groups()))
        for m in (re.search(r"(\d+) steps, not (\d+)", t) for t in slow.said)
        if m
    ]
    assert [old for _, old in said] == [decided] + [new for new, _ in said[:-1]], slow.said
    logged = [m for m in res.metrics if "lr" in m]
    assert logged[-1]["step"] == res.step and logged[-1]["lr"] == pytest.approx(
        3e-4
    )  # the decay ended
    # the rate held until the last count's decay began: no count fixed again cut into it; then it only fell
    f = json.loads((tmp_path / "run" / "run.json").read_text())["recipe"]["train"]["decay_fraction"]
    start = decay_start(res.step, f)
    assert {m["lr"] for m in logged if 5 < m["step"] <= start} <= {3e-3}
    decay = [m["lr"] for m in logged if m["step"] > start]
    assert all(a > b for a, b in zip(decay, decay[1:])), decay


def test_expected_final_loss_reads_the_curve_so_far():
    history = [{"step": s, "loss": 2.0 + 3.0 / math.sqrt(s)} for s in range(20, 400, 20)]
    assert expected_final_loss(history, 10_000, warmup_steps=10) == pytest.approx(2.03, abs=1e-6)
    assert expected_final_loss(history[:3], 10_000, 10) is None  # too few points
    rising = [{"step": s, "loss": 1.0 + s / 100} for s in range(20, 400, 20)]
    assert expected_final_loss(rising, 10_000, 10) is None


def test_a_budgeted_run_fixes_its_steps_and_ends_with_the_schedule_complete(tmp_path):
    res = pretrain(
        "cpu-smoke",
        tmp_path / "run",
        hours=0.002,
        device="cpu",
        progress=False,
        cache_dir=tmp_path / "c",
    )
    budget = json.loads((tmp_path / "run" / "budget.json").read_text())
    assert budget["hours"] == 0.002 and budget["decided_at_step"] >= 8 and budget["step_s"] > 0
    assert res.step == budget["max_steps"] > budget["decided_at_step"]
    logged = [m for m in res.metrics if "lr" in m]
    assert logged[-1]["step"] == res.step and logged[-1]["lr"] == pytest.approx(
        3e-4
    )  # cpu-smoke's min_lr
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["recipe"]["train"]["schedule"] == "wsd"
    # the recipe's own cosine gave way to wsd, and the start-up line (and its record) says so
    records = map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
    startup = next(m["startup"] for m in records if "startup" in m)
    assert "--hours trains with schedule wsd, not the recipe's cosine" in startup["notes"]
    with pytest.raises(ConfigError, match="not both"):
        PretrainOptions(run_dir=tmp_path / "x", hours=1, max_steps=10)
    with pytest.raises(ConfigError, match="positive"):
        PretrainOptions(run_dir=tmp_path / "x", hours=0)


def test_a_set_that_the_budget_would_override_is_refused_in_one_line_before_any_work(
    tmp_path, capsys
):
    """--hours decides the schedule (wsd) and the step count: a --set of either beside it cannot be
    honoured, so it is refused before anything is made, never replaced without a word."""
    run = tmp_path / "run"
    for sets, said in (
        (["train.schedule=cosine"], "--set train.schedule=cosine cannot be honoured with --hours"),
        (["train.max_steps=50"], "--set train.max_steps=50 and --hours both set the step count"),
    ):
        code = main(
            [
                "pretrain",
                "--recipe",
                "cpu-smoke",
                "--run-dir",
                str(run),
                "--device",
                "cpu",
                "--quiet",
                "--hours",
                "0.01",
                "--set",
                *sets,
            ]
        )
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and said in err, err
        assert not run.exists()


@pytest.mark.slow  # a real process killed
def test_a_budgeted_run_killed_after_its_decision_resumes_within_its_hours(tmp_path):
    """Killed after its budget was fixed, the same command without --hours resumes with the budget's hours; the
    resumed process measures its own steps and fixes the count again from them (budget.json comes back from a
    shared mirror too: its step time is never taken), its earlier steps costed at that time, so the hours asked
    are the hours its steps take, and it ends at the count it fixed, its schedule complete."""
    env = {**os.environ, "TINYGPT_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "tinygpt",
        "pretrain",
        "--recipe",
        "cpu-smoke",
        "--run-dir",
        str(run),
        "--save-every",
        "4",
        "--quiet",
        "--device",
        "cpu",
    ]
    p = subprocess.Popen(
        cmd + ["--hours", "0.01"],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if (run / "budget.json").is_file() and len(list((run / "checkpoints").glob("step_*"))) >= 2:
            break
        time.sleep(0.02)
    assert p.poll() is None, p.stdout.read().decode()
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    decided = json.loads((run / "budget.json").read_text())
    out = subprocess.run(
        cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )  # the same command without --hours: the run keeps its budget
    assert out.returncode == 0, out.stdout + out.stderr
    kept = json.loads((run / "budget.json").read_text())
    assert (
        kept["hours"] == decided["hours"] and kept["decided_at_step"] > decided["decided_at_step"]
    )
    assert abs(kept["max_steps"] * kept["step_s"] - 0.01 * 3600) <= 0.1 * 0.01 * 3600, kept
    steps = [
        m["step"]
        for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "loss" in m
    ]
    assert steps[-1] == kept["max_steps"] and f"step {kept['max_steps']}:" in out.stdout
    lrs = [
        m["lr"]
        for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "lr" in m
    ]
    assert lrs[-1] == pytest.approx(3e-4)  # the decay ended
