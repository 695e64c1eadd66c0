"""Verify rules by name (issue 62): each side keeps one registry of its rule objects, registered when their module
is imported; built-ins travel in the frame's own fields, others as ``F_RULE``. docs/specdec.md. Pure module."""

from __future__ import annotations

import importlib
from typing import Generic, Iterable, TypeVar

from specdec.errors import InvalidRequest

T = TypeVar("T")


class RuleRegistry(Generic[T]):
    """Rule objects of one side (``side``: named in errors), by name."""

    def __init__(self, side: str):
        self.side = side
        self._rules: dict[str, T] = {}

    def register(self, name: str, rule: T) -> T:
        if not name or not name.isascii() or len(name) > 255:
            raise ValueError(f"a rule's name is 1-255 ASCII characters, got {name!r}")
        if name in self._rules and self._rules[name] is not rule:
            raise ValueError(f"the {self.side} already has a rule {name!r}")
        self._rules[name] = rule
        return rule

    def get(self, name: str) -> T:
        """The rule ``name``; an unknown name is a 400 naming the rules this side has."""
        rule = self._rules.get(name)
        if rule is None:
            raise InvalidRequest(f"unknown verify rule {name!r}: the {self.side} has {sorted(self._rules)}")
        return rule

    def names(self) -> list[str]:
        return sorted(self._rules)


def import_rule_modules(modules: Iterable[str]) -> None:
    """Import each module (it registers its rules); one that cannot be imported: a ``ValueError`` naming it."""
    for m in modules:
        try:
            importlib.import_module(m)
        except ImportError as e:
            raise ValueError(f"verifier.rule_modules: cannot import {m!r}: {e}") from None
