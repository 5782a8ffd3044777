"""The model and what reads or writes it: the GPT, its losses, tokenizers, sampling, loading a run,
Hugging Face format."""
