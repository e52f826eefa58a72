"""Errors that reach users. Each message says what was wrong and what to do about it."""


class DarkError(Exception):
    """Base class for every error dark raises on purpose."""


class ModelLoadError(DarkError):
    """The model could not be found, downloaded, converted or read."""


class InvalidRequestError(DarkError, ValueError):
    """A request (prompt, sampling values, adapter name, example) is not acceptable as given."""


class PromptTooLongError(InvalidRequestError):
    """The prompt does not fit the context window."""


class UnknownAdapterError(InvalidRequestError, KeyError):
    """A request names an adapter (or adapter version) that does not exist."""

    def __str__(self) -> str:  # KeyError would wrap the message in quotes
        return str(self.args[0]) if self.args else ""
