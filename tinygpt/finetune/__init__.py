"""Finetuning with LoRA and QLoRA (peft, bitsandbytes) on the shared Trainer: instruction data,
recipes, the run."""

import logging


class _DropNote(logging.Filter):
    """Drops a record of one of bitsandbytes' loggers that begins with `prefix`, unless `matters()`;
    every other record of that logger, and every other logger, passes."""

    def __init__(self, prefix: str, matters=lambda: False):
        super().__init__()
        self.prefix, self.matters = prefix, matters

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix) or self.matters()


# On bitsandbytes' own loggers only, before anything here can import peft or bitsandbytes. peft
# imports bitsandbytes whenever it is installed, so a plain LoRA run (no quantization) printed these
# too. That an optional CPU kernel package (`kernels`) is missing: without it bitsandbytes uses its
# own CPU code, so nothing is wrong.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    _DropNote("Failed to load CPU gemm_4bit_forward from kernels-community")
)
# That bitsandbytes (0.46) was "compiled without GPU support": nothing is wrong where there is no
# GPU to use anyway; with a CUDA device the note means something is, and it passes (torch is
# imported already, by bitsandbytes, which is loading).
logging.getLogger("bitsandbytes.cextension").addFilter(
    _DropNote(
        "The installed version of bitsandbytes was compiled without GPU support",
        lambda: __import__("torch").cuda.is_available(),
    )
)
