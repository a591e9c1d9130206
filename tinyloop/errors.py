"""Every error the runtime raises derives from TinyLoopError, so callers can catch one type."""


class TinyLoopError(Exception):
    """Base class of all runtime errors."""


class ConfigError(TinyLoopError, ValueError):
    """A GenerateConfig, ModelConfig or environment value breaks a rule."""


class ModeError(TinyLoopError):
    """Two runtime modes that the mode matrix marks as incompatible were combined."""


class ArtifactError(TinyLoopError):
    """A .tinyloop file is missing, truncated, corrupted, mismatched or of an unknown version."""


class HandleError(TinyLoopError):
    """A handle was used with a model that did not build it, or after it was freed."""


class BudgetError(TinyLoopError):
    """A memory plan exceeds the budget it was checked against."""


class BusyError(TinyLoopError):
    """A model or handle is already in use by another call (they are not reentrant)."""


class ForwardError(TinyLoopError):
    """A forward several requests shared failed (not a fault of theirs): each request of that engine step fails with
    it, the others go on. Nothing of the request is wrong, so a service runs it again (`--max-attempts`)."""
