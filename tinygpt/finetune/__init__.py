"""Finetuning with LoRA and QLoRA (peft, bitsandbytes) on the shared Trainer: instruction data, recipes, the run."""
import logging


class _OptionalKernelNote(logging.Filter):
    """Drops bitsandbytes' note that an optional CPU kernel package (`kernels`) is missing. peft imports
    bitsandbytes whenever it is installed, so a plain LoRA run (no quantization) printed it too; without
    the package bitsandbytes uses its own CPU code, so nothing is wrong. Every other record of that
    logger, and every other logger, passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


# on bitsandbytes' optional-kernel logger only, before anything here can import peft or bitsandbytes
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_OptionalKernelNote())
