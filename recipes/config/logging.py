"""What a run logs and reports to: level, interval, TensorBoard, Weights & Biases
(``logging.*``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from recipes.checks import one_of, positive


@dataclass(kw_only=True)
class WandbConfig:
    enabled: bool = False  # needs the extra: pip install -e '.[wandb]'
    project: str = "mcore-recipes"  # W&B project
    entity: Optional[str] = None  # W&B entity (team); None: the default
    name: Optional[str] = None  # None: the run_id
    group: Optional[str] = None  # W&B run group
    mode: str = "offline"  # offline | online | disabled; offline: `wandb sync <run_dir>/wandb`

    def __post_init__(self) -> None:
        one_of("logging.wandb", "mode", self.mode, ("offline", "online", "disabled"))


@dataclass(kw_only=True)
class LoggingConfig:
    level: str = "INFO"  # DEBUG | INFO | WARNING
    log_interval: int = 1  # steps per console line; the line averages them
    tensorboard: bool = True  # event files in <run_dir>/tensorboard
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        one_of("logging", "level", self.level, ("DEBUG", "INFO", "WARNING", "ERROR"))
        positive("logging", log_interval=self.log_interval)
