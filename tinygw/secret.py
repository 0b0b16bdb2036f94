"""The one type that holds a secret (a provider key, a gateway key)."""

from __future__ import annotations


class Secret:
    """A key or token. Shown as `***` everywhere; `reveal()` is the one way out."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "***"

    __str__ = __repr__

    def __reduce__(self):  # never pickled into a log or a worker's argv
        raise TypeError("a Secret is not picklable")
