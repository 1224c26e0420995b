"""Errors users see. Each renders as one line naming where (file:line, config field or checkpoint
tensor), what was seen and what was wanted; the CLI prints ``str(err)`` and never a traceback."""

from __future__ import annotations


class MoERegistryError(Exception):
    """Base of every error this package raises on bad input."""


class SpecError(MoERegistryError):
    """A spec file that does not validate."""

    def __init__(self, path: str, line: int | None, message: str, field: str | None = None) -> None:
        self.path, self.line, self.field, self.message = path, line, field, message
        where = f"{path}:{line}" if line else path
        what = f"{field}: {message}" if field else message
        super().__init__(f"{where}: {what}")


class ConfigError(MoERegistryError):
    """A model config or runtime description that is missing something or is not understood."""


class CheckpointError(MoERegistryError):
    """A checkpoint tensor that is missing, unexpected, mis-shaped or holds bad values; the message
    names the full tensor name."""


class SelectionError(MoERegistryError):
    """The oracle found no scheme or no kernel; ``report`` holds every reason."""

    def __init__(self, message: str, report: object | None = None) -> None:
        self.report = report
        super().__init__(message)
