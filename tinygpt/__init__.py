"""tinygpt: train small GPT language models in Colab notebooks, on any GPU, with exact resume."""
__version__ = "0.1.0"

from .config import DataConfig, ModelConfig, Recipe, RECIPES, TrainConfig, get_recipe, model_config  # noqa: F401
