"""Finetuning with LoRA and QLoRA (peft, bitsandbytes) on
the shared Trainer: instruction data, recipes, the run."""

import logging


class _OptionalKernelNote(logging.Filter):
    """Drops bitsandbytes' note that an optional CPU kernel package (`kernels`) is missing. peft
    imports bitsandbytes whenever it is installed, so a plain LoRA run (no quantization) printed it
    too; without the package bitsandbytes uses its own CPU code, so nothing is wrong. Every other
    record of that logger, and every other logger, passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(
            "Failed to load CPU gemm_4bit_forward from kernels-community"
        )


class _NoGpuNote(logging.Filter):
    """Drops bitsandbytes' import-time note that it was "compiled without GPU support" (bitsandbytes
    0.46, as peft imports it on a plain LoRA run) where there is no GPU to use anyway; with a CUDA
    device the note means something is wrong, and it passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(
            "The installed version of bitsandbytes was compiled without GPU support"
        ):
            return True
        import torch  # already imported by bitsandbytes, which is loading

        return torch.cuda.is_available()


# on bitsandbytes' own loggers only, before anything here can import peft or bitsandbytes
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_OptionalKernelNote())
logging.getLogger("bitsandbytes.cextension").addFilter(_NoGpuNote())
