"""The one exception family for expected faults: each carries a one-line message and a hint."""


class GpucanaryError(Exception):
    """An expected fault, printed as one line: what is wrong, then what to do."""

    def __init__(self, message: str, *, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:
        message = super().__str__()
        return f"{message}; {self.hint}" if self.hint else message


class ConfigError(GpucanaryError):
    """Bad input: an option, a file or a value the user gave."""


class EnvError(GpucanaryError):
    """The environment cannot run us: a missing binary, a port in use, an unreachable cluster."""
