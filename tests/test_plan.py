"""The size planner (`--size auto --hours H`): the ladder, the law, the choice, and a planned run that keeps
its size when it resumes. Speeds in the choice tests come from a modelled machine (a fixed FLOP rate, so
that the choice is a function of the hours alone); the end-to-end runs time the real trainer step."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

import tinygpt.fit.ladder as ladder_mod
import tinygpt.fit.plan as plan_mod
from tinygpt.core.config import ConfigError
from tinygpt.core.recipes import get_recipe
from tinygpt.fit.ladder import (
    CHINCHILLA,
    LADDER_DEPTHS,
    LADDER_FIELDS,
    apply_plan,
    depth_of,
    effective_tokens,
    fitted_laws,
    law_for,
    rung,
    unique_tokens,
)
from tinygpt.fit.plan import MIN_STEPS, TIMED_RUNGS, kept_plan, plan_size
from tinygpt.fit.report import plan_note, plan_table, shortfall_note
from tinygpt.model.gpt import meta_model
from tinygpt.pretrain.run_pretrain import pretrain


def machine(flops_per_s: float, calls: list | None = None):
    """tokens/s of a machine that trains at a fixed FLOP rate (the recipe's own FLOPs per token)."""

    def speed(recipe):
        if calls is not None:
            calls.append(recipe.model.n_layer)
        return flops_per_s / meta_model(recipe.model).flops_per_token(recipe.train.seq_len)

    return speed


def test_a_rung_changes_only_the_ladder_fields_and_the_learning_rates():
    base = get_recipe("a100-124m")
    for depth in (4, 12, 24):
        r = rung(base, depth)
        assert (r.model.n_layer, r.model.d_model, r.model.n_head) == (depth, 64 * depth, depth)
        assert r.model.d_ff % 64 == 0 and 2.5 < r.model.d_ff / r.model.d_model < 2.8
        assert math.isclose(r.train.lr * r.model.d_model, base.train.lr * base.model.d_model)
        same = {k: v for k, v in r.model.to_dict().items() if k not in LADDER_FIELDS}
        assert same == {k: v for k, v in base.model.to_dict().items() if k not in LADDER_FIELDS}
        assert {k: v for k, v in r.train.to_dict().items() if k not in ("lr", "min_lr")} == {
            k: v for k, v in base.train.to_dict().items() if k not in ("lr", "min_lr")
        }
        assert r.data == base.data
    assert (
        rung(base, 12).model.d_model == base.model.d_model
    )  # GPT-2 small is a point on the ladder


def test_small_rungs_keep_four_heads_and_cpu_fast_is_its_ladders_d3():
    fast = get_recipe("cpu-fast")
    assert [(rung(fast, d).model.n_head, rung(fast, d).model.d_model) for d in (2, 3, 4, 5)] == [
        (4, 128),
        (4, 192),
        (4, 256),
        (5, 320),
    ]
    assert rung(fast, 3).model == fast.model and rung(fast, 3).train == fast.train


def test_more_hours_choose_a_larger_model_and_the_lowest_predicted_loss():
    recipe = get_recipe("a100-124m")
    sizes, ratios = [], []
    for hours in (0.05, 0.5, 3, 12):
        plan = plan_size(recipe, hours, machine(150e12), law=CHINCHILLA)
        c = plan.choice
        assert c.predicted_loss == min(x.predicted_loss for x in plan.candidates)
        assert math.isclose(c.predicted_loss, CHINCHILLA.loss(c.params, c.tokens))
        sizes.append(depth_of(plan.size))
        ratios.append(c.tokens_per_param)
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1], sizes
    assert 5 < ratios[2] < 100, ratios  # 3 h: Chinchilla's optimum, tens of tokens per parameter


def test_a_compiled_run_buys_more_tokens_with_the_same_timings():
    """`speedup` (timed eagerly, trained compiled) multiplies each rung's tokens and tokens/s, never
    the timings: the same rungs are timed (until a choice is confirmed by timing it), and the hours buy
    a larger (or the same) model."""
    recipe = get_recipe("a100-124m")
    plans = {}
    for up in (1.0, 2.5):
        calls: list[int] = []
        plans[up] = (
            plan_size(recipe, 0.5, machine(150e12, calls), law=CHINCHILLA, speedup=up),
            calls,
        )
    (eager, eager_calls), (compiled, compiled_calls) = plans[1.0], plans[2.5]
    assert eager_calls[:3] == compiled_calls[:3]  # the smallest rung, then the spread
    by_size = {c.size: c for c in eager.candidates}
    for c in compiled.candidates:
        if c.size in by_size:
            assert c.tokens == pytest.approx(2.5 * by_size[c.size].tokens)
            assert c.tokens_per_s == pytest.approx(2.5 * by_size[c.size].tokens_per_s)
    assert depth_of(compiled.size) >= depth_of(eager.size)
    assert compiled.choice.params >= eager.choice.params


def test_the_planner_times_a_few_rungs_and_never_one_the_hours_cannot_train():
    calls: list[int] = []
    recipe = get_recipe("cpu")
    plan = plan_size(recipe, 0.2, machine(2e10, calls))
    assert 1 <= len(calls) <= TIMED_RUNGS + plan_mod.CONFIRM_RUNGS and len(set(calls)) == len(calls)
    assert sum(c.timed for c in plan.candidates) == len(calls) and plan.choice.timed
    step_tokens = recipe.train.tokens_per_step
    for c in plan.candidates[1:]:
        assert (
            c.tokens >= MIN_STEPS * step_tokens
        )  # a rung with fewer steps than its warm-up is no candidate
    steps = plan_mod.PLAN_SPEED_STEPS + plan_mod.PLAN_WARMUP_STEPS
    timeable = [
        depth_of(c.size)
        for c in plan.candidates
        if steps * step_tokens / c.tokens_per_s <= plan_mod.timing_limit(0.2)
    ]
    assert max(calls) == max(timeable)  # the largest left whose timing fits is timed
    assert [r[0] for r in plan_table(plan)][1:] == [c.size for c in plan.candidates]
    assert sum("chosen" in r[-1] for r in plan_table(plan)) == 1


def test_the_plan_note_says_a_choice_under_one_token_per_parameter_as_it_is():
    """A short CPU budget chooses a rung trained on fewer tokens than it has parameters: the note says 0.5,
    not 0 (the table's figure), and names the law."""
    from tinygpt.fit.report import plan_note

    c = plan_mod.Candidate("d4", 4_262_656, 1_282.0, True, 2.08e6, 2.0, 3.474, chosen=True)
    d2 = plan_mod.Candidate("d2", 901_760, 4_100.0, True, 6.6e6, 6.0, 3.61)
    note = plan_note(
        plan_mod.SizePlan(0.5, "d4", {"source": "fitted on 10 tinygpt runs"}, [d2, c], 1.0)
    )
    assert (
        "0.5 tokens per parameter" in note and "(3.474; law: fitted on 10 tinygpt runs)" in note
    ), note
    assert "~" not in note  # every row was timed


def test_a_budget_below_the_plans_range_says_so_in_one_line_with_what_it_measured(capsys):
    """0.05 h on 2 CPU cores: every size above the smallest would train fewer than MIN_STEPS steps, so the plan
    is one row of a fraction of a token per parameter. The note says the budget is below the plan's range and
    shows the measured figures, with no "~" that no row carries; the table shows the fraction, not 0.0."""
    from tinygpt.fit.report import plan_note

    c = plan_mod.Candidate("d2", 901_888, 75.0, True, 12_150.0, 0.01, 6.41, chosen=True)
    plan = plan_mod.SizePlan(
        0.05, "d2", {"source": "fitted on 10 tinygpt runs", "min_tokens_per_param": 0.0}, [c], 1.0
    )
    note = plan_note(plan)
    assert "\n" not in note and "0.05 h is below the range the plan chooses in" in note, note
    assert f"fewer than {plan_mod.MIN_STEPS} steps" in note and "75 tokens/s" in note, note
    assert "0.013 tokens per parameter" in note and "~" not in note, note
    assert plan_table(plan)[1][4] == "0.013"


def test_a_run_whose_budget_buys_far_fewer_tokens_than_its_plan_is_told_so():
    """The plan timed d4 at 1,282 tokens/s; a run that trains at 800 buys 62% of the tokens: said, with
    what to do. At 1,000 (78%) nothing is said."""
    c = plan_mod.Candidate("d4", 4_262_656, 1_282.0, True, 2.08e6, 2.0, 3.474, chosen=True)
    plan = plan_mod.SizePlan(0.5, "d4", {"source": "fitted"}, [c], 1.0)
    note = shortfall_note(plan, 2.08e6 * 800 / 1282, 800.0)
    assert "d4 trains at 800 tokens/s here now, not the 1,282 the plan measured" in note, note
    assert "62% of the" in note and "tinygpt probe --hours" in note
    assert shortfall_note(plan, 2.08e6 * 1000 / 1282, 1000.0) is None
    scaled = plan_mod.SizePlan(
        0.5, "d4", {"source": "fitted"}, [dataclasses.replace(c, timed=False)], 1.0
    )
    assert "not the 1,282 the plan scaled from a timed size" in shortfall_note(scaled, 1e6, 800.0)


@pytest.mark.slow  # times real steps: a 7-second budgeted run (the re-fix in short form: test_budget.py)
def test_a_planned_run_that_slows_down_says_its_size_gets_fewer_tokens_than_planned(tmp_path):
    from test_budget import SlowAfterTheBudget

    slow = SlowAfterTheBudget(3.0)
    pretrain(
        "cpu-smoke",
        tmp_path / "r",
        size="auto",
        hours=0.002,
        device="cpu",
        progress=False,
        tensorboard=False,
        callbacks=[slow],
    )
    plan = json.loads((tmp_path / "r" / "run.json").read_text())["plan"]
    told = [m for m in slow.said if "the plan measured" in m]
    assert len(told) == 1 and told[0].startswith(f"size auto: {plan['size']} trains at "), slow.said


def test_a_long_budget_on_a_cpu_never_times_a_rung_whose_steps_take_minutes():
    """12 hours on a CPU keep rungs of hundreds of millions of parameters as candidates; timing one would
    take minutes, so the planner times only rungs whose few steps fit its limit (MAX_TIMING_S, or a share of a
    long budget up to MAX_TIMING_CAP_S) and scales the rest."""
    calls: list[int] = []
    recipe = get_recipe("cpu-fast")
    speed = machine(2e10, calls)
    plan = plan_size(recipe, 12, speed)
    steps = plan_mod.PLAN_SPEED_STEPS + plan_mod.PLAN_WARMUP_STEPS
    cost = {c.size: steps * recipe.train.tokens_per_step / c.tokens_per_s for c in plan.candidates}
    assert max(depth_of(c.size) for c in plan.candidates) >= 12  # large rungs are candidates...
    limit = plan_mod.timing_limit(12)
    assert limit == plan_mod.MAX_TIMING_CAP_S  # a share of 12 hours, capped
    assert all(cost[f"d{d}"] <= limit for d in calls), cost  # ...but never timed
    assert any(not c.timed and cost[c.size] > limit for c in plan.candidates)
    assert 2 <= len(calls) <= TIMED_RUNGS + plan_mod.CONFIRM_RUNGS
    # a machine on which even the smallest rung's timing is long (a GPU recipe's 0.5M-token steps on a CPU):
    # it alone is timed, once, and the plan is made
    slow: list[int] = []
    gpu_on_cpu = plan_size(get_recipe("a100-124m"), 12, machine(2e10, slow))
    assert slow == [2] and gpu_on_cpu.size in {c.size for c in gpu_on_cpu.candidates}


def overheads(flops_per_s: float, step_s: float, calls: list | None = None):
    """tokens/s of a machine whose every step also costs `step_s` of overheads (a CPU on a small model):
    FLOPs per token misjudge it, larger rungs run faster than the smallest one's speed scaled says."""
    flops = machine(flops_per_s, calls)

    def speed(recipe):
        step = recipe.train.tokens_per_step
        return step / (step_s + step / flops(recipe))

    return speed


def test_the_chosen_rung_is_timed_and_a_rung_that_reads_its_source_too_often_once_timed_is_dropped(
    monkeypatch,
):
    """On a machine FLOP scaling misjudges, a scaled choice is timed before it is kept: a rung that seemed
    to read a small source at most MAX_EPOCHS times can, timed, read it more; the choice moves on, and the
    rung finally chosen is a timed one, at its measured speed."""
    recipe = get_recipe("cpu-fast")
    speed = overheads(2e10, 0.05)
    plans = {}
    for unique in (3.5e5, 5e5, 7.4e5, 2e6):
        calls: list[int] = []
        plans[unique] = plan = plan_size(
            recipe, 0.67, overheads(2e10, 0.05, calls), timed=1, unique_tokens=unique
        )
        c = plan.choice
        assert c.timed and len(calls) <= 1 + plan_mod.CONFIRM_RUNGS, calls
        assert c.tokens_per_s == pytest.approx(speed(rung(recipe, depth_of(c.size))))
        assert c.epochs <= ladder_mod.MAX_EPOCHS
    monkeypatch.setattr(
        plan_mod, "CONFIRM_RUNGS", 0
    )  # the choice as FLOP scaling from d2 alone makes it
    scaled = {u: plan_size(recipe, 0.67, speed, timed=1, unique_tokens=u) for u in plans}
    moved = [u for u in plans if scaled[u].size != plans[u].size]
    assert moved, {u: (scaled[u].size, plans[u].size) for u in plans}
    assert any(
        scaled[u].choice.epochs
        <= ladder_mod.MAX_EPOCHS
        < next(x.epochs for x in plans[u].candidates if x.size == scaled[u].size)
        for u in moved
    )


def test_a_source_smaller_than_the_budget_counts_its_repeats_and_favours_a_larger_model():
    assert effective_tokens(1e6, None) == effective_tokens(1e6, 2e6) == 1e6
    assert 1e6 < effective_tokens(4e6, 1e6) < 4e6
    assert effective_tokens(1e12, 1e6) <= 1e6 * (1 + ladder_mod.REPEAT_HALF_LIFE) + 1
    recipe = get_recipe("a100-124m")
    free = plan_size(recipe, 12, machine(150e12), law=CHINCHILLA)
    small = plan_size(
        recipe, 12, machine(150e12), law=CHINCHILLA, unique_tokens=free.choice.tokens / 20
    )
    assert small.choice.epochs > 1
    assert depth_of(small.size) >= depth_of(free.size)


def test_a_rung_that_would_read_its_source_more_than_max_epochs_times_is_not_chosen():
    """The law alone would train the smallest rung on ~20 epochs of a tiny source (its repeats still count a
    little): the planner takes the best rung that reads it at most MAX_EPOCHS times, and says the epochs."""
    recipe = get_recipe("cpu-fast")
    speed = machine(2e10)
    free = plan_size(recipe, 0.67, speed)
    tiny = free.candidates[0].tokens / 20  # the smallest rung would read this source 20 times
    plan = plan_size(recipe, 0.67, speed, unique_tokens=tiny)
    assert plan.candidates[0].epochs > ladder_mod.MAX_EPOCHS
    assert plan.choice.epochs <= ladder_mod.MAX_EPOCHS
    allowed = [c for c in plan.candidates if c.epochs <= ladder_mod.MAX_EPOCHS]
    assert plan.choice.predicted_loss == min(c.predicted_loss for c in allowed)
    assert not plan.outside_law


def test_where_every_rung_reads_a_small_text_too_often_the_recipe_keeps_its_own_size():
    """A T4 with a Tiny-Shakespeare-sized text (250k tokens) for an hour: every rung would read it hundreds of
    times. The law, fitted at a few epochs, discounts the repeats but never the parameters, so it would
    choose the largest rung that fits; the planner keeps the rung nearest the recipe's own model and says
    why in the plan's note."""
    t4 = get_recipe("t4-50m")
    speed = machine(
        0.4 * 65e12
    )  # the T4's fp16 peak at an MFU of 0.4, as benchmarks/plan_on_paper.py
    plan = plan_size(t4, 1, speed, unique_tokens=2.5e5)
    assert all(c.epochs > ladder_mod.MAX_EPOCHS for c in plan.candidates)
    assert len(plan.candidates) > 4
    own = meta_model(t4.model).num_params(non_embedding=True)
    assert plan.size == "d8" and plan.choice.params == pytest.approx(
        own, rel=0.05
    )  # t4-50m is 8 x 512
    lowest = min(plan.candidates, key=lambda c: c.predicted_loss)
    assert depth_of(lowest.size) > 8  # what the law alone would have trained
    assert plan.outside_law and apply_plan(t4, plan).model.n_layer == 8
    note = plan_note(plan)
    assert "recipe's own size" in note and "more than 4 times" in note and "\n" not in note
    assert "0.31 tokens per parameter" in note
    # on the CPU ladder too: cpu-fast's own model is its d3
    fast = get_recipe("cpu-fast")
    none_fit = plan_size(fast, 0.67, machine(2e10), unique_tokens=1000)
    assert none_fit.outside_law and none_fit.size == "d3"
    # one rung within the law is enough for the law to choose
    d8 = next(c for c in plan.candidates if c.size == "d8")
    some = plan_size(t4, 1, speed, unique_tokens=d8.tokens / 3)
    assert not some.outside_law and some.choice.epochs <= ladder_mod.MAX_EPOCHS


def test_a_rung_that_would_see_fewer_tokens_per_parameter_than_the_laws_runs_is_not_chosen():
    """A 12M-token text on an A100 for an hour: every rung up to d24 would read it more than MAX_EPOCHS times,
    and the law would take d32, 1.6B parameters on 0.02 tokens each, far below any run Chinchilla's fit was
    made on (5B tokens at 16B parameters at the fewest). No rung is left within the law: the recipe's own
    size is kept, as it is with 3 hours. A fitted law's floor is its own runs' fewest."""
    a100 = get_recipe("a100-124m")
    speed = machine(0.4 * 312e12)
    assert CHINCHILLA.min_tokens_per_param == pytest.approx(5 / 16)
    plan = plan_size(a100, 1, speed, law=CHINCHILLA, unique_tokens=12e6)
    unbounded = plan_size(
        a100,
        1,
        speed,
        law=dataclasses.replace(CHINCHILLA, min_tokens_per_param=0.0),
        unique_tokens=12e6,
    )
    assert (
        unbounded.choice.tokens_per_param < 0.1 and not unbounded.outside_law
    )  # what it was before
    assert plan.outside_law and plan.size == "d12" and rung(a100, 12).model == a100.model
    assert plan_size(a100, 3, speed, law=CHINCHILLA, unique_tokens=12e6).size == "d12"
    # with data to spare the floor changes nothing: Chinchilla's ~20 tokens per parameter is far above it
    free = plan_size(a100, 1, speed, law=CHINCHILLA)
    assert not free.outside_law and free.choice.tokens_per_param > 5
    for name, law in fitted_laws().items():
        runs = json.loads(
            (ladder_mod.resources.files("tinygpt.fit") / ladder_mod.LAWS_FILE).read_text()
        )
        assert law.min_tokens_per_param == min(
            r["tokens"] / r["params"] for r in runs["laws"][name]["runs"]
        )


def test_a_plan_read_back_may_name_only_a_rung_of_the_ladder():
    assert kept_plan({}) is None
    assert kept_plan({"plan": {"size": "d4"}}) == {"size": "d4"}
    for bad in ("d7", "../d4", "124m", 4, None, "d"):
        with pytest.raises(ConfigError, match="not on the ladder"):
            kept_plan({"plan": {"size": bad}})
    with pytest.raises(ConfigError):
        kept_plan({"plan": "d4"})
    row = {
        "size": "d4",
        "params": 4e6,
        "tokens": 1e6,
        "tokens_per_s": 900.0,
        "predicted_loss": 3.5,
        "chosen": True,
    }
    assert kept_plan({"plan": {"size": "d4", "candidates": [row]}})["candidates"] == [row]
    for bad in (
        {"params": "4e6"},
        {"predicted_loss": float("nan")},
        {"tokens": -1},
        {"chosen": "yes"},
        {"epochs": "3"},
        {"epochs": -1.0},
    ):
        with pytest.raises(
            ConfigError, match="not a plan tinygpt wrote"
        ):  # what the notebook's plot would draw
            kept_plan({"plan": {"size": "d4", "candidates": [row | bad]}})
    for hours in ("1", 0, float("inf")):  # the plot's title reads the hours
        with pytest.raises(ConfigError, match="not a plan tinygpt wrote"):
            kept_plan({"plan": {"size": "d4", "hours": hours, "candidates": [row]}})
    assert all(depth_of(f"d{d}") == d for d in LADDER_DEPTHS)


@pytest.mark.parametrize("name", ["cpu", "cpu-fast"])
def test_the_shipped_fitted_law_predicts_its_held_out_runs_within_5_percent(name):
    laws = fitted_laws()
    if name not in laws:
        pytest.skip(
            f"no law fitted on the {name} ladder shipped (benchmarks/fit_scaling.py --write writes it)"
        )
    data = json.loads(
        (ladder_mod.resources.files("tinygpt.fit") / ladder_mod.LAWS_FILE).read_text()
    )["laws"][name]
    law, unique = laws[name], unique_tokens(get_recipe(name))
    assert law_for(get_recipe(name)) == law
    assert data["held_out_max_error"] is not None and data["held_out_max_error"] <= 0.05
    for run in data[
        "runs"
    ]:  # the constants are the ones the runs beside them gave (D counted as planned)
        predicted = law.loss(run["params"], effective_tokens(run["tokens"], unique))
        assert abs(predicted - run["val_loss"]) / run["val_loss"] < 0.1


def test_a_local_source_counts_the_tokens_its_files_hold_without_reading_them(tmp_path):
    """A small corpus is data-limited at a budget its recipe's cap would not be: the planner counts the
    file's size (at most the cap), so a 40-minute plan on a 1 MB file knows it reads it many times."""
    text = tmp_path / "corpus.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 4000)
    size = text.stat().st_size
    cpu = get_recipe("cpu")  # a 4M-character cap
    on_file = cpu.replace(data=dict(source=str(text)))
    per_token = ladder_mod.CHARS_PER_TOKEN["train"] / (
        1 - cpu.data.val_fraction
    )  # the training split's
    assert unique_tokens(on_file) == pytest.approx(size / per_token)
    assert unique_tokens(on_file.replace(data=dict(max_chars=1000))) == pytest.approx(
        1000 / per_token
    )
    assert unique_tokens(cpu) == pytest.approx(
        cpu.data.max_chars / per_token
    )  # the stdlib is larger
    hub = cpu.replace(data=dict(source="hf:roneneldan/TinyStories", max_chars=None))
    assert (
        unique_tokens(hub) is None
    )  # no network asked: a Hub corpus counts as larger than any budget
    assert unique_tokens(
        cpu.replace(data=dict(source=str(tmp_path / "gone.txt")))
    ) == pytest.approx(cpu.data.max_chars / per_token)  # refused later, by the data's own check


def test_the_characters_per_token_the_planner_assumes_are_what_a_trained_tokenizer_reads():
    """The epochs a plan counts rest on CHARS_PER_TOKEN (the tokenizer does not exist yet when the plan is
    made): a 4096-token BPE trained on the built-in corpus, as the CPU recipes train theirs, reads within 10%
    of it on 2M characters of that corpus."""
    from tinygpt.data.sources import iter_documents
    from tinygpt.model.tokenizer import train_bpe

    d = get_recipe("cpu-fast").data
    sample = type(d)(**{**d.to_dict(), "max_chars": 2_000_000})
    tokenizer = train_bpe(iter_documents(sample), d.vocab_size)
    text = "".join(iter_documents(sample))
    per_token = len(text) / len(tokenizer.encode(text))
    assert per_token == pytest.approx(ladder_mod.CHARS_PER_TOKEN["train"], rel=0.1), per_token


def test_size_auto_without_a_recipe_climbs_the_cpu_fast_ladder_on_a_cpu(tmp_path):
    """On a CPU `--size auto` plans cpu-fast's family (it beat cpu's ladder at 10 minutes,
    docs/BENCHMARKS.md section 13); without --size, and on a GPU, the default recipe is unchanged."""
    from tinygpt.core.gpu_classes import HARDWARE, size_auto_recipe
    from tinygpt.fit.hardware import hardware_report
    from tinygpt.pretrain.init import default_recipe

    report = hardware_report("cpu")
    assert default_recipe(tmp_path / "new")[0] == report.default_recipe == "cpu"
    name, why = default_recipe(tmp_path / "new", sized=True)
    assert name == "cpu-fast" and "--size auto" in why
    assert size_auto_recipe("t4", "x") == HARDWARE["t4"].default_recipe
    assert size_auto_recipe("unlisted", "cpu") == "cpu"


def test_size_auto_needs_hours_and_says_so_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="--size auto chooses the size that --hours buys"):
        pretrain("cpu-smoke", tmp_path / "r", size="auto", device="cpu", progress=False)
    assert not (tmp_path / "r").exists()


def test_size_auto_with_a_base_is_refused_before_the_base_is_read(tmp_path, capsys):
    from tinygpt.cli import main

    gone = tmp_path / "no-such-base"  # read, it would fail with another message
    assert (
        main(
            [
                "pretrain",
                str(tmp_path / "r"),
                "--init",
                str(gone),
                "--hours",
                "0.1",
                "--size",
                "auto",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "a continued base (--init) keeps its own: leave out --size" in err
        and len(err.splitlines()) == 1
    )
    assert not (tmp_path / "r").exists()


def test_a_planned_run_trains_the_chosen_rung_and_resumes_at_its_size_without_planning(
    tmp_path, monkeypatch
):
    run = tmp_path / "r"
    result = pretrain(
        "cpu-smoke", run, size="auto", hours=0.002, device="cpu", progress=False, tensorboard=False
    )
    info = json.loads((run / "run.json").read_text())
    plan = info["plan"]
    chosen = [c for c in plan["candidates"] if c["chosen"]]
    assert len(chosen) == 1 and chosen[0]["size"] == plan["size"]
    expected = rung(get_recipe("cpu-smoke"), depth_of(plan["size"]))
    assert {k: info["recipe"]["model"][k] for k in LADDER_FIELDS} == {
        k: expected.model.to_dict()[k] for k in LADDER_FIELDS
    }
    assert info["recipe"]["train"]["lr"] == expected.train.lr
    assert result.step >= 1

    def no_timing(*a, **k):
        raise AssertionError("a resumed planned run planned again")

    monkeypatch.setattr(plan_mod, "trainer_speed", no_timing)
    # resumed with more hours (another machine would time other speeds): the size is the one in run.json
    again = pretrain(
        "cpu-smoke", run, size="auto", hours=0.003, device="cpu", progress=False, tensorboard=False
    )
    assert json.loads((run / "run.json").read_text())["plan"]["size"] == plan["size"]
    assert again.step >= result.step
    # a kept plan applies only under --size auto: without it, the refusal says to add it
    with pytest.raises(ConfigError, match="add --size auto to resume it"):
        pretrain("cpu-smoke", run, hours=0.003, device="cpu", progress=False, tensorboard=False)


@pytest.mark.slow  # times real steps: an 11-second budgeted CLI run (short form: test_where_every_rung_...)
def test_a_planned_run_on_a_text_every_rung_would_read_too_often_trains_the_recipes_size(
    tmp_path, capsys
):
    """End to end through the CLI: a 5 KB text, 40% of it held out (~1k tokens to train on) for 10 seconds:
    even at a few hundred tokens/s the smallest rung would read it more than MAX_EPOCHS times. The run trains
    the recipe's own size, keeps why in run.json, says it, and the notebook's plot marks every rung outside
    the law."""
    from tinygpt.cli import main

    text = tmp_path / "poem.txt"
    text.write_text(
        "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(100))
    )
    run = tmp_path / "r"
    assert (
        main(
            [
                "pretrain",
                str(run),
                "--recipe",
                "cpu-smoke",
                "--data",
                str(text),
                "--hours",
                "0.003",
                "--size",
                "auto",
                "--device",
                "cpu",
                "--set",
                "data.val_fraction=0.4",
            ]
        )
        == 0
    )
    plan = json.loads((run / "run.json").read_text())["plan"]
    assert plan["outside_law"] is True and all(
        c["epochs"] > ladder_mod.MAX_EPOCHS for c in plan["candidates"]
    )
    own = meta_model(get_recipe("cpu-smoke").model).num_params(non_embedding=True)
    nearest = min(plan["candidates"], key=lambda c: abs(math.log(c["params"] / own)))
    assert plan["size"] == nearest["size"]
    out = capsys.readouterr()
    assert "the recipe's own size" in out.out + out.err
    pytest.importorskip("matplotlib")
    from tinygpt.colab import plan_plot

    ax = plan_plot(run, show=False).axes[0]
    crossed = next(line for line in ax.lines if line.get_label().startswith("outside the law"))
    assert len(crossed.get_xdata()) == len(plan["candidates"])
    assert "the recipe's own size" in ax.lines[-1].get_label()


def test_the_notebook_shows_the_plan_and_its_picker_plans_only_with_a_time(tmp_path):
    from tinygpt.colab import plan_plot
    from tinygpt.colab.pickers import RecipePicker
    from tinygpt.fit.hardware import hardware_report

    run = tmp_path / "r"
    pretrain(
        "cpu-smoke", run, size="auto", hours=0.001, device="cpu", progress=False, tensorboard=False
    )
    pytest.importorskip("matplotlib")
    fig = plan_plot(run, show=False)
    plan = json.loads((run / "run.json").read_text())["plan"]
    assert fig is not None and (run / "plots" / "plan.png").stat().st_size > 1000
    points = fig.axes[0].lines[0].get_xydata()
    assert [tuple(p) for p in points] == [
        (c["params"], c["predicted_loss"]) for c in plan["candidates"]
    ]
    assert plan_plot(tmp_path / "unplanned", show=False) is None
    picker = RecipePicker(
        hardware_report("cpu")
    )  # a CPU: no time budget by default, so the recipe's size
    assert picker.hours is None and picker.size is None and "size: the recipe's" in repr(picker)


@pytest.mark.slow  # times real steps: plans twice (short form: test_colab_summary_with_hours_shows_the_same_plan)
def test_probe_with_hours_prints_the_plan_it_would_train(capsys):
    from tinygpt.cli import main

    assert main(["probe", "--recipe", "cpu-smoke", "--hours", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "Size plan for 0.01 h" in out and "<- chosen" in out and "size auto: d" in out
    assert main(["probe", "--recipe", "cpu-smoke", "--hours", "0.01", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert (
        sum(c["chosen"] for c in plan["candidates"]) == 1
        and depth_of(plan["size"]) in LADDER_DEPTHS
    )


def test_colab_summary_with_hours_shows_the_same_plan():
    from tinygpt.colab import summary
    from tinygpt.fit.hardware import hardware_report

    tables = summary("cpu-smoke", hardware_report("cpu"), hardware=False, hours=0.01)
    plan = tables[-1]
    assert plan.title == "Size plan for 0.01 h" and plan.rows[0][0] == "size"
    assert sum("chosen" in r[-1] for r in plan.rows) == 1 and plan.notes[0].startswith(
        "size auto: d"
    )


@pytest.mark.slow  # times real steps: three budgeted runs (short form: test_a_planned_run_trains_the_chosen_rung...)
def test_a_run_planned_on_an_older_ladder_resumes_as_it_began(tmp_path, monkeypatch):
    """A ladder changed between two tinygpt versions (here: its heads): a run planned on the older resumes
    at the model it began with, not refused as another configuration."""
    run = tmp_path / "r"
    with monkeypatch.context() as old:  # the ladder before its rungs kept 4 heads
        old.setattr(
            ladder_mod, "rung", lambda recipe, depth, min_heads=1: rung(recipe, depth, min_heads=1)
        )
        first = pretrain(
            "cpu-smoke",
            run,
            size="auto",
            hours=0.002,
            device="cpu",
            progress=False,
            tensorboard=False,
        )
    began = json.loads((run / "run.json").read_text())["recipe"]
    assert began["model"]["n_head"] == began["model"]["d_model"] // 64 < 4
    again = pretrain(
        "cpu-smoke", run, size="auto", hours=0.003, device="cpu", progress=False, tensorboard=False
    )
    now = json.loads((run / "run.json").read_text())["recipe"]
    assert again.step >= first.step  # resumed (its budget was fixed at the start), not refused
    assert (now["model"], now["train"]["lr"]) == (began["model"], began["train"]["lr"])
    # heads neither ladder has are not taken from run.json (a mirror's could say them): refused, as another run
    info = json.loads((run / "run.json").read_text())
    info["recipe"]["model"].update(n_head=8, n_kv_head=8)
    (run / "run.json").write_text(json.dumps(info))
    with pytest.raises(ConfigError, match="model.n_head: 8 in the run, 4 now"):
        pretrain(
            "cpu-smoke",
            run,
            size="auto",
            hours=0.003,
            device="cpu",
            progress=False,
            tensorboard=False,
        )


def test_the_planners_own_time_is_bounded_compiles_included():
    """A timing may take tens of seconds (on an H100 a 1-hour plan whose timings compiled ran past 200 s).
    A modelled machine whose every timing takes 40 s: a 1-hour plan (90 s for planning) begins a
    second timing (40 + 40 <= 90) but not a third, and says the rest are scaled; a 12-hour one (300 s) times
    as many rungs as it would with instant timings. The first timing is always taken."""
    from tinygpt.fit.plan import PLAN_TIME_MAX_S, may_time, planning_limit

    assert planning_limit(1) == 90 and planning_limit(12) == PLAN_TIME_MAX_S == 300
    recipe = get_recipe("a100-124m")
    now = [0.0]

    def clock():
        return now[0]

    def slow(calls):
        fast = machine(2e14, calls)

        def speed(r):
            now[0] += 40.0  # the timed steps
            return fast(r)

        return speed

    short, instant, long_ = [], [], []
    plan = plan_size(recipe, 1.0, slow(short), clock=clock)
    assert len(short) == 2 and plan.seconds == 80.0 <= planning_limit(1)
    assert (
        sum(c.timed for c in plan.candidates) == 2 and sum(c.chosen for c in plan.candidates) == 1
    )
    plan_size(recipe, 12.0, machine(2e14, instant))  # timings that take no time: not limited
    now[0] = 0.0
    plan = plan_size(recipe, 12.0, slow(long_), clock=clock)
    assert len(long_) == len(instant) >= TIMED_RUNGS and plan.seconds <= planning_limit(12)
    assert (
        may_time(0.0, [], 1.0) and not may_time(60.0, [40.0], 90.0) and may_time(50.0, [40.0], 90.0)
    )
