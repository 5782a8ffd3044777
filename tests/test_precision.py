"""Precision follows compute capability, not torch.cuda.is_bf16_supported()."""

import pytest
import torch

from tinygpt.core.precision import choose_precision, native_bf16


@pytest.fixture
def fake_gpu(monkeypatch):
    def set_capability(cap):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        monkeypatch.setattr(
            torch.cuda, "is_bf16_supported", lambda *a, **k: True
        )  # what a T4 reports

    return set_capability


@pytest.mark.parametrize(
    "cap,name",
    [((7, 5), "fp16"), ((7, 0), "fp16"), ((8, 0), "bf16"), ((8, 9), "bf16"), ((9, 0), "bf16")],
)
def test_cuda_precision_follows_compute_capability(fake_gpu, cap, name):
    fake_gpu(cap)
    p = choose_precision(torch.device("cuda"), "auto")
    assert p.name == name and p.use_scaler == (name == "fp16")
    assert f"{cap[0]}.{cap[1]}" in p.reason


def test_t4_asked_for_bf16_is_warned_about(fake_gpu):
    fake_gpu((7, 5))
    assert not native_bf16(torch.device("cuda"))
    p = choose_precision(torch.device("cuda"), "bf16")
    assert p.name == "bf16" and "emulated" in p.reason


def test_cpu_defaults_to_fp32_and_can_be_overridden():
    assert choose_precision(torch.device("cpu")).name == "fp32"
    assert choose_precision(torch.device("cpu"), "bf16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="precision must be"):
        choose_precision(torch.device("cpu"), "fp8")


def test_autocast_and_scaler_behave_on_cpu():
    p = choose_precision(torch.device("cpu"), "bf16")
    lin = torch.nn.Linear(8, 8)
    with p.autocast():
        assert lin(torch.randn(2, 8)).dtype == torch.bfloat16
    assert not p.grad_scaler().is_enabled()
    fp16 = choose_precision(torch.device("cpu"), "fp16")
    assert fp16.grad_scaler().is_enabled()


TF32_AFTER_TRANSFORMERS = """
import warnings
import torch
from tinygpt.core.precision import enable_tf32
new_api = hasattr(torch.backends.cudnn, "conv")  # torch 2.9 and later
if new_api:
    torch.backends.fp32_precision = "tf32"  # what transformers' enable_tf32 does on torch 2.9 and later
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    enable_tf32()
assert not caught, [str(w.message)[:120] for w in caught]  # e.g. "Please use the new API settings ... TF32"
readers = [torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()]
assert readers == [True, True, "high"], readers  # the legacy readers answer (they raise on a mixed state)
if new_api:
    assert torch.backends.cuda.matmul.fp32_precision == torch.backends.cudnn.conv.fp32_precision == "tf32"
lin = torch.nn.Linear(8, 8)
f = torch.compile(lambda x: lin(x).relu())
f(torch.randn(4, 8)).sum().backward()
print("ok")
"""


@pytest.mark.slow  # torch.compile
def test_tf32_after_the_new_api_leaves_every_reader_agreeing_and_compiles():
    """transformers sets the new fp32_precision API first; tinygpt's TF32 setup then leaves the legacy and the new
    readers in agreement (torch raises on a mix, and 2.9's Inductor reads the legacy flag on CUDA), warns about
    nothing, and a compile runs. In a child process: the settings are global."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run(
        [sys.executable, "-c", TF32_AFTER_TRANSFORMERS],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
