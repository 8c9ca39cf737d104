"""The config error and the small checks every config dataclass validates itself with."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value is invalid; the message names the key and what to do."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def positive(owner: str, **values: int | None) -> None:
    for key, value in values.items():
        require(value is None or value >= 1, f"{owner}.{key} must be >= 1, got {value}")


def one_of(owner: str, key: str, value: str, allowed: tuple[str, ...]) -> None:
    require(value in allowed, f"{owner}.{key}={value!r} is not one of {list(allowed)}")
