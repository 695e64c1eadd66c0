"""The draft-session protocol of the tree rules: what the agent's tree rounds
(:mod:`edge_agent.tree_rounds`) ask of a generation's drafts, whichever way they are drawn.
Notes: docs/edge_agent.md, "edge_agent/tree_session.py"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from edge_agent.tree_builder import TreeConfig
from specdec.tree import DraftTree


@dataclass
class Alignment:
    """What the reply did to the proactive chain."""

    attempted: bool  # a proactive token existed when the reply came
    aligned: bool  # complete draft alignment
    reused: int  # proactive tokens carried into the next tree


@runtime_checkable
class TreeSession(Protocol):
    """One generation's draft trees, one round at a time."""

    forward_times: list[float]  # seconds of every draft forward so far (the agent reads the new ones)

    @property
    def forwards(self) -> int:
        """Draft forwards that built the current tree (its depth in SpecEdge's sense)."""

    def start(self, prefix: list[int], config: TreeConfig | None = None) -> None:
        """Begin drafting after ``prefix`` (a new generation or a re-opened session)."""

    def set_config(self, config: TreeConfig) -> None:
        """Budget / top-k / depth limits for the next growth."""

    def draft(self, depth: int) -> int:
        """Grow the tree by up to ``depth`` draft forwards; returns how many ran."""

    def freeze(self, max_chain: int = 0) -> tuple[DraftTree, list[int]]:
        """The tree to send and its node ids in wire order; allows a proactive chain of at most
        ``max_chain`` tokens below it."""

    def confidences(self, order: list[int]) -> list[int] | None:
        """One byte per sent node (cumulative draft log-prob) for the server's truncation; None: none."""

    def proposals(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | None:
        """Per position (root, then node i): the sparse q its children were drawn from; None: none sent."""

    def proactive_step(self) -> bool:
        """One draft forward of proactive work while the reply is away; False: nothing more to do."""

    def on_reply(self, accepted: list[int], bonus: int | None, emitted: list[int]) -> Alignment:
        """Apply a verification (``accepted`` node indices of the sent tree, the ``bonus`` token,
        every ``emitted`` token) and prepare the next tree."""
