"""The side concerns of a run, each a `Callback` that decides its own timing: the progress display,
the start-up record with the compile cache, MFU, TensorBoard, and the samples a run writes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from tinygpt.core import checkpoint as ckpt
from tinygpt.core.callback import Callback
from tinygpt.core.config import ConfigError, ModelConfig
from tinygpt.core.rundir import RunDir
from tinygpt.model.generate import generate_text
from tinygpt.model.gpt import GPT
from tinygpt.model.tokenizer import Tokenizer
from tinygpt.train.budget import end_time
from tinygpt.train.compile_cache import CompileCache
from tinygpt.train.startup import StartupClock
from tinygpt.train.step import eager


class TensorBoardLogger(Callback):
    """Trainer callback: every logged metric as a TensorBoard scalar, x axis = step. The writer (its
    event file) is made when training starts, so a run that fails before it leaves none."""

    def __init__(self, log_dir: Path, summary_writer: Any):
        self.log_dir, self.summary_writer, self.writer = Path(log_dir), summary_writer, None

    @classmethod
    def create(cls, log_dir: Path, required: bool = False) -> "TensorBoardLogger | None":
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # optional: Colab has it; elsewhere `pip install tensorboard`
            if required:
                raise ConfigError("TensorBoard logging needs `pip install tensorboard`") from None
            return None
        return cls(log_dir, SummaryWriter)

    def on_start(self, trainer: Any, resumed_from: int | None) -> None:
        if self.writer is None:
            self.writer = self.summary_writer(str(self.log_dir))

    def on_log(self, metrics: dict) -> None:
        for k, v in metrics.items():
            if self.writer is not None and k != "step" and isinstance(v, (int, float)):
                name = f"train/{k}" if k != "val_loss" else "val/loss"
                self.writer.add_scalar(name, v, metrics["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def write_sample(
    model: GPT, tokenizer: Tokenizer, run_dir: Path, step: int, prompt: str | None = None
) -> str:
    """Append a generated sample to samples.txt and return it. Generated eagerly: under
    train.compile=regional the model's own blocks are compiled, and sampling with a KV cache would
    compile a graph per layer and length for a few hundred tokens."""
    model.eval()
    with eager():
        text = generate_text(
            model,
            tokenizer,
            prompt or "def ",
            max_new_tokens=120,
            temperature=0.8,
            top_k=50,
            seed=0,
        )
    RunDir(run_dir).append_sample(step, text)
    model.train()
    return text


class Samples(Callback):
    """What the model writes, appended to samples.txt on rank 0: every `every` steps (0: none on the
    way) and once when the run reaches its last step, from that step's checkpoint. Under FSDP rank 0
    holds only a shard: `whole` (the model's config) rebuilds the model from that checkpoint.
    `prompt` may be a function, called at the first sample (`sample_prompt` waits for the first
    shard; the run compiles meanwhile)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        run_dir: Path,
        every: int = 0,
        prompt: str | None | Callable[[], str | None] = None,
        whole: ModelConfig | None = None,
    ):
        self.tokenizer, self.run_dir, self.every = tokenizer, Path(run_dir), every
        self.prompt, self.whole = prompt, whole
        self.trainer: Any = None

    def on_start(self, trainer: Any, resumed_from: int | None) -> None:
        self.trainer = trainer
        if trainer.is_main:  # a resumed run writes the samples after its checkpoint again
            RunDir(self.run_dir).keep_samples_through(resumed_from or 0)

    def on_step(self, trainer: Any) -> None:
        due = self.every and trainer.step % self.every == 0 and trainer.step != trainer.max_steps
        if due and trainer.is_main:
            write_sample(trainer.model, self.tokenizer, self.run_dir, trainer.step, self._prompt())

    def _prompt(self) -> str | None:
        if callable(self.prompt):
            self.prompt = self.prompt()
        return self.prompt

    def on_checkpoint(self, path: str | Path, step: int) -> None:
        t = self.trainer  # (only rank 0 is told of a checkpoint)
        if t is None or step != t.max_steps or Path(path) != t.ckpt_root / ckpt.step_name(step):
            return  # not the last step's own checkpoint (best/ is told too)
        model = t.model
        if self.whole is not None:
            model = GPT(self.whole)
            ckpt.load_model_state(model, ckpt.load_checkpoint(path)[0])
            model.to(t.device)
        write_sample(model, self.tokenizer, self.run_dir, step, self._prompt())


def sample_prompt(asked: str | None, source: str, tokenizer: Tokenizer, tokens: Any) -> str | None:
    """The samples' prompt: the one asked for or, on a corpus other than the built-in one (whose
    held-out code would make an odd prompt), how a held-out document begins (its first 8 tokens)."""
    val = tokens.validation(8)
    if asked is None and source not in ("builtin", "stdlib") and len(val) >= 8:
        return tokenizer.decode(val[:8].tolist())
    return asked


class Progress(Callback):
    """The training bar: tqdm's in a terminal, a widget in a notebook that ends as its final line,
    and where output goes to a file (CI, nohup, a Colab %%capture), no carriage-return bar but one
    plain line per logged step, at most one every `min_interval_s` (the last step's always)."""

    def __init__(self, min_interval_s: float = 10.0, stream: Any = None):
        self.min_interval_s, self.stream = min_interval_s, stream
        self.bar: Any = None
        self.trainer: Any = None
        self._last_line = -float("inf")

    def on_start(self, trainer: Any, resumed_from: int | None) -> None:
        self.trainer = trainer
        if not trainer.is_main:
            return
        stream = self.stream or sys.stderr
        if _in_notebook() or _is_terminal(stream):
            self.bar = progress_bar(
                total=trainer.max_steps,
                initial=trainer.step,
                desc="training",
                unit="step",
                dynamic_ncols=True,
                file=self.stream,
            )

    def on_step(self, trainer: Any) -> None:
        if self.bar is not None:
            if self.bar.total != trainer.max_steps:  # a time budget decided the step count
                self.bar.total = trainer.max_steps
            self.bar.update(1)

    def on_log(self, m: dict) -> None:
        if self.trainer is None or not self.trainer.is_main:
            return
        t = self.trainer
        post = {k: f"{m[k]:.4g}" for k in ("loss", "val_loss", "lr") if m.get(k) is not None}
        if m.get("tokens_per_s"):
            post["tok/s"] = f"{m['tokens_per_s']:.0f}"
        if m.get("expected_final_loss") is not None:
            post["final~"] = f"{m['expected_final_loss']:.4g}"
        if t.step_s and t.max_steps:
            post["ends"] = end_time(t.step, t.max_steps, t.step_s)
        if self.bar is not None:
            self.bar.set_postfix(post, refresh=False)
            return
        # a file: one line per logged step, not more often than min_interval_s
        now = time.monotonic()
        if now - self._last_line >= self.min_interval_s or m["step"] == t.max_steps:
            self._last_line = now
            of = f"/{t.max_steps}" if t.max_steps else ""
            fields = ", ".join(f"{k} {v}" for k, v in post.items())
            self.on_message(f"training step {m['step']}{of}: {fields}")

    def on_message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        elif self.trainer is not None and self.trainer.is_main:
            print(text, file=self.stream or sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _is_terminal(stream: Any) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _in_notebook() -> bool:
    """A Jupyter kernel (Colab's included), where tqdm.auto gives the widget bar."""
    try:
        from tqdm.notebook import tqdm as notebook_tqdm  # needs ipywidgets
    except ImportError:
        return False
    return issubclass(tqdm, notebook_tqdm)


class StartupReport(Callback):
    """After the first step of this process: keep the compiler's work for the next VM (the compile
    cache, loaded before the first step), record where start-up went in metrics.jsonl, say it."""

    def __init__(self, clock: StartupClock | None, compile_cache: CompileCache | None = None):
        self.clock, self.compile_cache, self.done = clock, compile_cache, False

    def on_start(self, trainer: Any, resumed_from: int | None) -> None:
        if self.compile_cache is not None and trainer.use_compile and trainer.is_main:
            note = self.compile_cache.load()
            if note and self.clock is not None:
                self.clock.notes.append(note)

    def on_step(self, trainer: Any) -> None:
        if self.done:
            return
        self.done = True
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)  # the first step's time includes its kernels
        if self.clock is not None:
            self.clock.mark("first_step")
        if self.compile_cache is not None and trainer.use_compile and trainer.is_main:
            self.compile_cache.save()
        if self.clock is not None and trainer.is_main:
            record = self.clock.record()
            RunDir(trainer.run_dir).append_metrics({"step": trainer.step, "startup": record})
            # a notebook's table replaces the line
            if not any(cb.shows_startup for cb in trainer.callbacks):
                trainer.say(self.clock.summary())
            for cb in trainer.callbacks:
                cb.on_startup(record)
        trainer.throughput.restart()  # tokens/s counts steady steps, not the compile


class MFU(Callback):
    """Model FLOPs utilisation in each logged record: tokens/s x FLOPs per token (the trained
    model's, at its context, read when training starts) over the peak of the GPUs."""

    def __init__(self, peak_tflops: float | None):
        self.peak_tflops, self.flops_per_token, self.world_size = peak_tflops, None, 1

    def on_start(self, trainer: Any, resumed_from: int | None) -> None:
        self.world_size = trainer.world_size
        # (also when FSDP2 has sharded it: its class derives from GPT)
        if isinstance(trainer.model, GPT):
            self.flops_per_token = trainer.model.flops_per_token(trainer.cfg.seq_len)

    def on_metrics(self, m: dict) -> None:
        if m.get("tokens_per_s") and self.peak_tflops and self.flops_per_token:
            peak = self.peak_tflops * 1e12 * self.world_size  # the table's peak is one GPU's
            m["mfu"] = round(m["tokens_per_s"] * self.flops_per_token / peak, 4)


def progress_bar(**kwargs):
    """A tqdm bar: text in a terminal, a widget in a notebook. In a notebook the widget is displayed
    under a display id and replaced by its final line when the bar closes, so the output a notebook
    saves (what GitHub and nbviewer show, which cannot run widgets) is the last state, not 0%."""
    if not _in_notebook():  # a terminal bar
        return tqdm(**kwargs)
    kwargs.pop("file", None)
    bar = tqdm(display=False, **kwargs)
    from IPython.display import display  # a notebook bar implies IPython

    handle = display(_widget_bundle(bar.container), raw=True, display_id=True)
    close = bar.close

    def close_and_keep_last_state() -> None:
        # the final line, e.g. "training: 100%|##########| 300/300 [01:49<00:00, ...]"
        text = str(bar)
        close()
        # the widget becomes that line: in the live view and in the saved output
        if handle is not None:
            handle.update({"text/plain": text}, raw=True)

    bar.close = close_and_keep_last_state
    return bar


def _widget_bundle(widget) -> dict:
    """The widget's display data, published by us. ipywidgets 7 (Colab's) displays a widget through
    its own `_ipython_display_`, which drops the display id: the closing update then matched no
    output, and the saved notebook kept the bar at 0%."""
    text = repr(widget)
    return {
        "text/plain": text[:110] + "…" if len(text) > 110 else text,
        "application/vnd.jupyter.widget-view+json": widget.get_view_spec(),
    }
