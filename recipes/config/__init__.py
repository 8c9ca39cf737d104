"""Structured configs, a module per concern (each config with its children): one kw_only
dataclass per section, validated in ``__post_init__``.

Checks that need two concerns (model x parallel) live in :class:`recipes.config.run.RunConfig`;
checks that need the launch environment (world size, device) live in :mod:`recipes.validate`.
"""
