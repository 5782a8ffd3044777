"""The one hardware table (`core.gpu_classes.HARDWARE`): every class's entry is what the rest of tinygpt reads, and
every name in it points at something that exists."""

from __future__ import annotations

import pytest
import torch

from tinygpt.core.gpu_classes import HARDWARE
from tinygpt.core.precision import choose_precision
from tinygpt.core.recipes import RECIPES
from tinygpt.finetune.presets import FINETUNE_RECIPES, finetune_device
from tinygpt.fit.hardware import GPU_TABLE, gpu_class, gpu_spec


@pytest.mark.parametrize("name", list(HARDWARE))
def test_every_class_names_a_recipe_and_finetuning_settings_that_exist(name):
    c = HARDWARE[name]
    assert c.name == name and c.default_recipe in RECIPES
    assert all(c.finetune in r.train for r in FINETUNE_RECIPES.values())
    assert (c.device_type == "cuda") == (c.capability is not None) == bool(c.gpus)
    for gpu, _ in c.gpus:  # a listed GPU is put into its own class
        assert gpu_spec(f"NVIDIA {gpu}")[1] == name and gpu_class(f"NVIDIA {gpu}", 0, 0.0) == name


def test_every_recipe_is_made_for_a_class_of_the_table():
    assert {r.hardware for r in RECIPES.values()} <= set(HARDWARE)


def test_a_class_precision_is_what_the_device_rule_gives(monkeypatch):
    assert HARDWARE["cpu"].precision == choose_precision(torch.device("cpu")).name == "fp32"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    for c in HARDWARE.values():
        if c.device_type == "cuda":
            capability = c.capability
            assert choose_precision(torch.device("cuda")).name == c.precision, c.name


def test_finetuning_devices_follow_the_table():
    assert finetune_device("t4") == ("cuda", (7, 5), torch.float16)
    assert finetune_device("a100") == ("cuda", (8, 0), torch.bfloat16)
    assert finetune_device("cpu") == ("cpu", None, torch.float32)


def test_gpu_names_are_matched_longest_first_as_whole_words():
    assert [len(n) for n, _, _ in GPU_TABLE] == sorted(
        (len(n) for n, _, _ in GPU_TABLE), reverse=True
    )
    assert gpu_spec("NVIDIA H100 PCIe") == (756.0, "h100") and gpu_spec(
        "NVIDIA H100 80GB HBM3"
    ) == (989.0, "h100")
    assert gpu_spec("NVIDIA L40S")[1] == "a100" and gpu_spec("NVIDIA L4")[1] == "l4"
    assert gpu_spec("NVIDIA GH200 480GB") == (989.0, "h200")


def test_colab_g4_is_its_own_class_that_the_probe_reports_and_the_picker_serves(monkeypatch):
    """Colab's G4 (RTX PRO 6000 Blackwell, 96 GB, sm_120): before its entry it was taken for an H100 with no peak."""
    from dataclasses import replace

    from tinygpt import colab
    from tinygpt.fit.hardware import hardware_report

    name = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    assert gpu_spec(name) == (500.0, "g4") and gpu_class(name, 12, 95.0) == "g4"
    g4 = HARDWARE["g4"]
    assert g4.precision == "bf16" and g4.default_recipe == "a100-124m" and g4.finetune == "a100"
    monkeypatch.delenv("TINYGPT_SMOKE", raising=False)
    report = replace(
        hardware_report("cpu"),
        device="cuda",
        name=name,
        hardware_class="g4",
        default_recipe=g4.default_recipe,
    )
    picker = colab.recipe_picker(report)
    assert picker.value == "a100-124m" and "g4 runtime" in picker.reason and picker.hours == 2.0
