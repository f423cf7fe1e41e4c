"""The engine's one kind of bad-input error: a ``ValueError`` that names the argument as data."""

from __future__ import annotations


class ParameterError(ValueError):
    """``param`` was given a value the engine cannot use; ``str(error)`` starts with its name.

    The OpenAI server answers it with a 400 whose ``param`` is ``error.param`` (and ``code``, if
    set), so rewording a message never changes which field the API blames.
    """

    def __init__(self, param: str, message: str, code: str | None = None) -> None:
        super().__init__(f"{param} {message}")
        self.param = param
        self.code = code
