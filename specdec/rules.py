"""Verify rules by name (issue 62): each side keeps one registry of its rule objects.

A rule is one object per side: the edge's round strategy (:mod:`edge_agent.rules`) and the
verifier's handling (:mod:`deploy.verifier.rules`), registered under the same name. The built-in
rules (``match``, ``tree-rejection``, ``rejection``) travel in the frame's own fields; any other
travels as ``F_RULE``: its name and its own payload (:class:`specdec.protocol.VerifyFrame`). A
rule module registers itself when imported (``verifier.rule_modules`` on the cloud; an import on
the edge), as SGLang registers its speculative algorithms. Pure module.
"""

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
    """Import each module (each registers its rules on import); one that cannot be imported is a
    ``ValueError`` naming it."""
    for m in modules:
        try:
            importlib.import_module(m)
        except ImportError as e:
            raise ValueError(f"verifier.rule_modules: cannot import {m!r}: {e}") from None
