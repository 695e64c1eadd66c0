"""The verifier engine's session state, requests and results (:class:`specdec.engine.VerifierEngine`).

Tree requests and results: SpecEdge §4.1 (the edge drafts, the server verifies); chain requests
and results: DSSD §3 (the rejection's reply, :class:`~specdec.residual.Rejection`, on the wire).
Their wire forms: :mod:`specdec.protocol`, ``docs/protocol.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec import clock
from specdec.errors import InvalidRequest, SpecError
from specdec.logprobs import TokenLogprob
from specdec.model.batch import SeqInput, tree_input
from specdec.penalties import penalties_for
from specdec.proposal import Proposal
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree


@dataclass
class Session:
    """One open session: its tokens, sampling state and stop condition (KV: ``prefix[:-1]``)."""

    sid: str
    prefix: list[int]  # prompt + emitted tokens; prefix[-1] is the root
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    finished: bool = False
    finish_reason: str | None = None
    awaiting_resample: bool = False  # chain mode: the edge owes the resampled token
    residual_tail: torch.Tensor | None = None  # chain mode: [vocab] p's tail at the rejected position (refills)
    last_used: float = field(default_factory=clock.monotonic)
    adapter: str | None = None  # target version (LoRA adapter); None: the base
    cache_salt: str | None = None  # who may share its cached KV (the tenant)
    grammar: object | None = None  # specdec.grammar.GrammarState: masks its rows, follows its tokens

    @property
    def num_generated(self) -> int:
        return len(self.prefix) - self.prompt_len

    def penalties(self, vocab: int, device):
        """Penalties of its history now (None unless its params penalise)."""
        return penalties_for(self.params, self.prefix[: self.prompt_len], self.prefix[self.prompt_len:], vocab, device)


@dataclass(frozen=True)
class OpenRequest:
    """Open a session on a prompt, or re-open one from its history (``generated``)."""

    sid: str
    prompt: list[int]
    params: SamplingParams
    generated: tuple[int, ...] = ()  # re-open: tokens the session already emitted
    adapter: str | None = None  # target version (deploy/verifier/adapters.py); None: the base
    cache_salt: str | None = None  # prefix caching: sessions share cached KV only within one salt (the tenant)
    start_by: float | None = None  # monotonic time: dropped if still waiting behind another prompt then
    grammar: object | None = None  # specdec.grammar.GrammarState: the session's output follows it


@dataclass(frozen=True)
class OpenResult:
    """A prefilled session: its first token (sampled by the target) and prefix length."""

    sid: str
    first_token: int | None  # None when re-opened from history
    prefix_len: int
    finished: bool
    finish_reason: str | None
    cached_tokens: int = 0  # of the prompt + history, taken from the prefix cache (not computed)
    first_logprob: TokenLogprob | None = None  # when the params ask for logprobs


@dataclass(frozen=True)
class VerifyRequest:
    """A draft tree to verify against a session whose prefix has ``prefix_len`` tokens."""

    sid: str
    tree: DraftTree
    prefix_len: int  # the prefix length the edge assumes (root included)
    limit: int | None = None  # verify only the first ``limit`` nodes (server-side truncation)
    early: bool = False  # stream early results (exit heads, specdec/exit_heads.py) to ``on_early``
    # tree rejection sampling: per position (root, then node i), the (ids, weights) its children
    # were drawn from without replacement (acceptance.py); such trees are never truncated
    proposals: tuple | None = None


@dataclass(frozen=True)
class VerifyResult:
    """A verified tree: the accepted path (node indices of the tree sent) and the bonus token."""

    sid: str
    accepted: tuple[int, ...]  # node indices of the accepted path
    bonus: int | None  # None only if max_tokens/stop ended the session on an accepted node
    tokens: tuple[int, ...]  # emitted this round: accepted tokens (+ bonus)
    prefix_len: int  # after this round
    finished: bool
    finish_reason: str | None
    verified: int = 0  # nodes of the tree verified (all of them unless truncated)
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per emitted token, when the params ask for them


@dataclass(frozen=True)
class ChainVerifyRequest:
    """DSSD-split rejection sampling: chain tokens with the draft's q(x) per token.

    ``more``: the edge used up a rejection's tail candidates before its residual sampler
    accepted one and asks for fresh ones (no tokens; ``prefix_len`` counts the owed
    token). Sent to a session that owes nothing (re-opened from history after it was
    lost), it asks for a rejection reply for the next position instead.
    """

    sid: str
    tokens: tuple[int, ...]
    q: tuple[float, ...]
    prefix_len: int
    resampled: int | None = None  # the residual sample owed after a rejection
    more: bool = False


@dataclass(frozen=True)
class ChainVerifyResult:
    """On rejection (``bonus`` None, not finished): the edge's :class:`~specdec.residual.Rejection`,
    head (``reject_top_*``: all of p when ``tail_mass`` is 0) and tail candidates."""

    sid: str
    num_accepted: int
    bonus: int | None  # None on rejection: the edge resamples from the residual
    reject_top_ids: tuple[int, ...] = ()
    reject_top_probs: tuple[float, ...] = ()
    prefix_len: int = 0
    finished: bool = False
    finish_reason: str | None = None
    tail_mass: float = 0.0
    tail_ids: tuple[int, ...] = ()
    tail_probs: tuple[float, ...] = ()

    @property
    def rejected(self) -> bool:
        return self.bonus is None and not self.finished

    @classmethod
    def of_rejection(cls, sid: str, num_accepted: int, rej, prefix_len: int) -> "ChainVerifyResult":
        return cls(sid, num_accepted, None, rej.head_ids, rej.head_probs, prefix_len, False, None,
                   rej.tail_mass, rej.tail_ids, rej.tail_probs)


@dataclass(frozen=True)
class ForwardStats:
    """One target forward, as observed by the engine (pacing and metrics read these)."""

    kind: str  # "prefill" | "verify" | "chain"
    sessions: int
    tokens: int  # new tokens in the batch (packed: no padding)
    seconds: float
    prefill_tokens: int = 0  # of which prompt tokens (a prefill chunk riding along a verify forward)
    # CPU time of the calling thread (on a CPU replica, seconds - cpu_seconds: the core was taken by
    # other processes; pipeline stages in other processes and GPU work are not in it)
    cpu_seconds: float = 0.0


@dataclass
class TreeJob:
    """One admitted request of a :meth:`~specdec.engine.VerifierEngine.verify` batch."""

    index: int  # of the request in the batch
    session: Session
    tree: DraftTree  # as verified (a prefix of what was sent, clipped near the context's end)
    kept: tuple[int, ...] | None  # after a clip: node j of ``tree`` is node kept[j] of the sent tree
    verified: int  # nodes of the sent tree verified (all of them unless truncated by ``limit``)
    proposals: tuple[Proposal | None, ...] | None  # tree rejection sampling: per position of ``tree``


def check_ids(ids, vocab_size: int, what: str) -> None:
    """Raise :class:`~specdec.errors.InvalidRequest` unless every token id is in the vocabulary."""
    for t in ids:
        if not (0 <= int(t) < vocab_size):
            raise InvalidRequest(f"{what}: token id {t} is outside the vocabulary [0, {vocab_size})")


def admit_batch(requests: list, admit_one, job_type: type) -> tuple[list, list]:
    """One batch's admission: per request its error, or its answer given without a forward (None
    where it became a job), and the jobs for the forward. ``admit_one(i, request)`` validates
    (raising the request's :class:`~specdec.errors.SpecError`, its session intact) and returns a
    ``job_type`` or an answer; a session twice in one batch is refused the second time."""
    out: list = [None] * len(requests)
    jobs: list = []
    seen: set[str] = set()
    for i, r in enumerate(requests):
        try:
            if r.sid in seen:
                raise InvalidRequest(f"session {r.sid!r} appears twice in one batch")
            admitted = admit_one(i, r)
        except SpecError as e:
            out[i] = e
            continue
        seen.add(r.sid)
        if isinstance(admitted, job_type):
            jobs.append(admitted)
        else:
            out[i] = admitted
    return out, jobs


def tree_item(s: Session, tree: DraftTree) -> SeqInput:
    """A session's root (``prefix[-1]``, at the KV's end) and its tree, as one forward input."""
    item = tree_input(s.sid, len(s.prefix) - 1, s.prefix[-1], tree.tokens, tree.parents, tree.depths)
    item.adapter = s.adapter
    return item
