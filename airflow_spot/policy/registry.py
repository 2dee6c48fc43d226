"""Policies registered by name, one default per kind (after SkyPilot's strategy registry)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class PolicyRegistry:
    """Name -> policy factory for one kind of decision; unknown names list the valid ones."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, Callable] = {}
        self.default: str | None = None

    def register(self, name: str, *, default: bool = False) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} policy {name!r} is already registered")
            self._items[name] = obj  # type: ignore[assignment]
            if default:
                self.default = name
            return obj

        return deco

    def names(self) -> list[str]:
        return sorted(self._items)

    def get(self, name: str | None = None) -> Callable:
        key = name or self.default
        if key not in self._items:
            raise ValueError(
                f"unknown {self.kind} policy {name!r}; valid {self.kind} policies: {', '.join(self.names())}"
            )
        return self._items[key]
