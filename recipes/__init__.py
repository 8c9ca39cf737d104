"""Hydra config tree for mcore-recipes: structured schema plus named YAML recipes."""

from recipes.config.run import RunConfig
from recipes.load import ConfigError, list_recipes, load_config, to_yaml

__all__ = ["ConfigError", "RunConfig", "load_config", "list_recipes", "to_yaml"]
