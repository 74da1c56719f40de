"""Errors shared by the engine and the tasks (imports nothing of ds_infcl)."""

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A run config or DeepSpeed config value that cannot be used; the message names the key.

    The CLI prints it as one ``config error: ...`` line and exits with status 2.
    """
