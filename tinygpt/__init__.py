"""tinygpt: train small GPT language models in Colab notebooks, on any GPU, with exact resume."""
__version__ = "0.1.0"

from tinygpt.core.config import (  # noqa: F401
    DataConfig,
    ModelConfig,
    Recipe,
    TrainConfig,
)
from tinygpt.core.recipes import RECIPES, get_recipe, model_config  # noqa: F401
