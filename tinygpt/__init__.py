"""tinygpt: train small GPT language models in Colab notebooks, on any GPU, with exact resume.

Importing the package imports nothing else: the names below load on first use, so the `tinygpt`
command can take Ctrl-C from its first moment (`__main__.py`) before any module of its own loads."""

__version__ = "0.1.0"

_LAZY = {
    "DataConfig": "tinygpt.core.config",
    "ModelConfig": "tinygpt.core.config",
    "Recipe": "tinygpt.core.config",
    "TrainConfig": "tinygpt.core.config",
    "RECIPES": "tinygpt.core.recipes",
    "get_recipe": "tinygpt.core.recipes",
    "model_config": "tinygpt.core.recipes",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tinygpt' has no attribute {name!r}")
