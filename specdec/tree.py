"""Draft token trees: structure, depths, paths, validation (positions and masks: :mod:`specdec.model.batch`).
``parents[i]``: -1 for a child of the root, else < i (parents first); depth 1: the root's children. The root is the
prefix's last token, not in the KV yet; the bonus, the target's sample ending a round (SpecEdge §4.1-4.2)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from specdec.errors import InvalidTree


@dataclass(frozen=True)
class TreeLimits:
    max_nodes: int = 64
    max_depth: int = 32


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    @classmethod
    def chain(cls, tokens) -> "DraftTree":
        tokens = tuple(int(t) for t in tokens)
        return cls(tokens, tuple(range(-1, len(tokens) - 1)))

    @classmethod
    def empty(cls) -> "DraftTree":
        return cls((), ())

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return tuple(d)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """children[0] = children of the root; children[i + 1] = children of node i."""
        ch: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents):
            ch[p + 1].append(i)
        return tuple(tuple(c) for c in ch)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def prefix(self, n: int) -> "DraftTree":
        """The first ``n`` nodes: a tree, since parents come first (server-side truncation)."""
        return DraftTree(self.tokens[:n], self.parents[:n])

    def clip(self, max_depth: int) -> tuple["DraftTree", tuple[int, ...]]:
        """The nodes at depth <= ``max_depth`` (a subtree: parents first) and each kept node's index in this tree."""
        kept = tuple(i for i, d in enumerate(self.depths) if d <= max_depth)
        new_index = {old: new for new, old in enumerate(kept)}
        parents = tuple(-1 if self.parents[i] < 0 else new_index[self.parents[i]] for i in kept)
        return DraftTree(tuple(self.tokens[i] for i in kept), parents), kept

    def validate(self, vocab_size: int, limits: TreeLimits = TreeLimits(), allow_empty: bool = True) -> "DraftTree":
        n = len(self.tokens)
        if len(self.parents) != n:
            raise InvalidTree(f"tree has {n} tokens but {len(self.parents)} parent indices")
        if n == 0 and not allow_empty:
            raise InvalidTree("empty tree")
        if n > limits.max_nodes:
            raise InvalidTree(f"tree has {n} nodes, the limit is {limits.max_nodes}")
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            if not (0 <= t < vocab_size):
                raise InvalidTree(f"node {i}: token id {t} is outside the vocabulary [0, {vocab_size})")
            if not (-1 <= p < i):
                raise InvalidTree(f"node {i}: parent {p} must be -1 (root) or an earlier node index")
        if self.depth > limits.max_depth:
            raise InvalidTree(f"tree depth {self.depth} exceeds the limit {limits.max_depth}")
        return self
