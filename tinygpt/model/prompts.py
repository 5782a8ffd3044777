"""The instruction prompt format, shared by training data, generation and export: the templates, the
prompt of one instruction (`format_prompt`), and `Codec`, what encoding needs of a tokenizer
(tinygpt's or a transformers one): the token a prompt starts with, the end-of-text token, and a
batch encoder.

Finetuning (`finetune.instruct`) trains on these prompts, `model.generate.generate_response` asks
with them, and `publish` writes them into an exported model's chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TEMPLATES: dict[str, tuple[str, str]] = {
    # (with input, without input); the response follows the template directly.
    "alpaca": (
        "Below is an instruction that describes a task, paired with an input that provides further "
        "context. Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n",
    ),
    "short": (
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
        "### Instruction:\n{instruction}\n\n### Response:\n",
    ),
}

Segments = list[tuple[str | None, bool]]  # (text, carries loss); text None: the eos token


def format_prompt(instruction: str, input: str = "", template: str = "alpaca") -> str:
    """The prompt text for one instruction; the model's answer is expected right after it."""
    if template not in TEMPLATES:
        raise ValueError(
            f"unknown prompt template {template!r}; choose one of {', '.join(TEMPLATES)}"
        )
    with_input, without = TEMPLATES[template]
    if input and input.strip():
        return with_input.format(instruction=instruction.strip(), input=input.strip())
    return without.format(instruction=instruction.strip())


class Codec:
    """What encoding prompts needs of a tokenizer: tinygpt's `Tokenizer` or a transformers one."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        # tinygpt: documents end with end-of-text, so it also starts one
        if hasattr(tokenizer, "eot_id"):
            self.bos_id, self.eos_id = tokenizer.eot_id, tokenizer.eot_id
            self.encode_batch, self.chat_template = tokenizer.encode_batch, None
        else:
            self.bos_id, self.eos_id = tokenizer.bos_token_id, tokenizer.eos_token_id
            if self.eos_id is None:
                raise ValueError("the tokenizer has no eos token, so a response cannot be ended")
            # verbose=False: no "sequence length is longer than the maximum" warning; the caller
            # truncates to its seq_len and reports the truncated examples itself
            self.encode_batch = lambda texts: tokenizer(
                list(texts), add_special_tokens=False, verbose=False
            )["input_ids"]
            self.chat_template = (
                self._render_chat if getattr(tokenizer, "chat_template", None) else None
            )
        self.pad_id = self.eos_id

    def _render_chat(self, messages: list, **kwargs: Any) -> Any:
        """The tokenizer's `apply_chat_template`; a template that cannot render (jinja2's sandbox
        refusing an attribute, an error raised in it) fails in one line naming its file."""
        try:
            return self.tokenizer.apply_chat_template(messages, **kwargs)
        except Exception as e:  # noqa: BLE001 (whatever the base's template raised)
            base = Path(str(getattr(self.tokenizer, "name_or_path", "") or "."))
            file = (
                base / "chat_template.jinja"
            )  # transformers reads it before tokenizer_config.json
            file = file if file.is_file() else base / "tokenizer_config.json"
            why = " ".join(str(e).split())[:200] or "it raised an error"
            raise ValueError(
                f"{file}: the base's chat template cannot render a conversation "
                f"({why}); use a base whose chat template renders"
            ) from None

    def encode_examples(self, segments: list[Segments]) -> list[tuple[list[int], list[bool]]]:
        """(ids, trained flags) per example: [bos] + segments, a None segment the eos token."""
        flat = [t for segs in segments for t, _ in segs if t is not None]
        enc = iter(self.encode_batch(flat) if flat else [])
        out = []
        for segs in segments:
            ids, flags = ([self.bos_id], [False]) if self.bos_id is not None else ([], [])
            for text, trained in segs:
                piece = [self.eos_id] if text is None else next(enc)
                ids += piece
                flags += [trained] * len(piece)
            out.append((ids, flags))
        return out
