"""The edge <-> cloud protocol: JSON for session control, compact binary for verify (little-endian, version 1).
Each frame's ``decode`` raises :class:`InvalidRequest` on a short, malformed or inconsistent frame or an unknown flag,
:class:`PayloadTooLarge` past the node limit. Token ids only (DSSD/PicoSpec); the spec: docs/protocol.md."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace

from pydantic import BaseModel, ConfigDict, Field

from specdec.errors import InvalidRequest, PayloadTooLarge
from specdec.frame_sections import decode_proposals, decode_rule, encode_proposals, encode_rule

MAGIC = 0x5345  # "SE"
VERSION = 1
MAX_NODES_WIRE = 4096

_REQ_HEAD = struct.Struct("<HBBIHHff")  # magic, version, flags, prefix_len, n, depth_hint, draft_ms, rtt_ms
_REP_HEAD = struct.Struct("<HBBBBHIIBxHI")  # magic, ver, flags, finish, _, n_acc, prefix_len, bonus, depth, budget, K

_TAIL_HEAD = struct.Struct("<fH")  # R_TAIL: tail mass, candidates

F_CHAIN, F_RESAMPLED, F_CONF, F_MORE, F_TREEQ = 1, 2, 4, 8, 16  # request flags
F_EARLY = 32  # request flag: stream early results (EarlyFrame) before the reply
F_AHEAD = 64  # request flag: the server may run ahead (decode on past the bonus) while trees do not pay
F_RULE = 128  # request flag: a registered rule's name and payload follow the tree (specdec.rules)
# the rule a frame's rule flag names, and the option flags that rule takes: any other flag is a 400
_RULE_OPTIONS = {0: ("match", F_CONF | F_EARLY | F_AHEAD | F_RESAMPLED),
                 F_CHAIN: ("rejection", F_RESAMPLED | F_MORE | F_CONF),
                 F_TREEQ: ("tree-rejection", F_CONF), F_RULE: ("registered", 0)}
# options that exclude each other: an early stream, a run-ahead reply and an owed residual sample
# each change what the round's reply holds
_EXCLUSIVE = ((F_EARLY, F_AHEAD), (F_EARLY, F_RESAMPLED), (F_AHEAD, F_RESAMPLED))
EARLY_MAGIC = 0x4545  # "EE"
_EARLY_HEAD = struct.Struct("<HBBIHHIf")  # magic, ver, flags, prefix_len, layer, n_acc, token, confidence
R_FINISHED, R_HAS_BONUS, R_REJECTED, R_TRUNCATED, R_TAIL, R_AHEAD = 1, 2, 4, 8, 16, 32  # reply flags
R_LOGPROBS = 64  # reply flag: the target's log-probs of the emitted tokens (sessions whose sampling asks)
_LOGPROBS_HEAD = struct.Struct("<HB")  # R_LOGPROBS: tokens m, alternatives k per token
FINISH_CODES = {None: 0, "stop": 1, "length": 2}
FINISH_NAMES = {v: k for k, v in FINISH_CODES.items()}


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-prob under the target and its ``top`` most likely alternatives."""

    token: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def to_dict(self) -> dict:
        return {"token": self.token, "logprob": self.logprob, "top_ids": list(self.top_ids),
                "top_logprobs": list(self.top_logprobs)}

    @classmethod
    def from_dict(cls, d: dict) -> "TokenLogprob":
        return cls(int(d["token"]), float(d["logprob"]), tuple(d["top_ids"]), tuple(d["top_logprobs"]))


def _encode_logprobs(lps: list[TokenLogprob]) -> bytes:
    """``R_LOGPROBS``'s bytes: u16 m, u8 k, m logprobs f32, m * k ids u32, m * k logprobs f32."""
    k = len(lps[0].top_ids) if lps else 0
    if any(len(lp.top_ids) != k or len(lp.top_logprobs) != k for lp in lps):
        raise ValueError("every token carries the same number of alternatives")
    ids = [i for lp in lps for i in lp.top_ids]
    vals = [v for lp in lps for v in lp.top_logprobs]
    return (_LOGPROBS_HEAD.pack(len(lps), k) + struct.pack(f"<{len(lps)}f", *(lp.logprob for lp in lps))
            + struct.pack(f"<{len(ids)}I", *ids) + struct.pack(f"<{len(vals)}f", *vals))


def _decode_logprobs(data: bytes, off: int, tokens: list[int]) -> list[TokenLogprob]:
    """The ``R_LOGPROBS`` section at ``off``, which must end the frame, for the emitted ``tokens``."""
    if len(data) < off + _LOGPROBS_HEAD.size:
        raise InvalidRequest("malformed reply frame")
    m, k = _LOGPROBS_HEAD.unpack_from(data, off)
    off += _LOGPROBS_HEAD.size
    if m != len(tokens) or len(data) != off + 4 * m + 8 * m * k:
        raise InvalidRequest("malformed reply frame")
    chosen = struct.unpack_from(f"<{m}f", data, off)
    ids = struct.unpack_from(f"<{m * k}I", data, off + 4 * m)
    vals = struct.unpack_from(f"<{m * k}f", data, off + 4 * m + 4 * m * k)
    return [TokenLogprob(t, c, ids[j * k:(j + 1) * k], vals[j * k:(j + 1) * k])
            for j, (t, c) in enumerate(zip(tokens, chosen))]


@dataclass(frozen=True)
class VerifyHeader:
    """A verify frame's fixed header (:meth:`VerifyFrame.header`)."""

    flags: int
    prefix_len: int
    nodes: int
    depth: int
    draft_ms: float
    rtt_ms: float

    @property
    def early(self) -> bool:
        return bool(self.flags & F_EARLY)


@dataclass
class VerifyFrame:
    """One verify round: a draft tree (or chain with q) for the prefix the edge assumes."""

    prefix_len: int
    tokens: list[int]
    parents: list[int]
    draft_ms: float = 0.0  # edge-measured time per draft forward
    rtt_ms: float = 0.0  # edge-measured network round trip
    depth: int = 0  # number of draft forwards that built the tree
    q: list[float] | None = None  # chain mode: q(x) of each draft token
    resampled: int | None = None  # chain mode: residual sample owed after a rejection
    conf: list[int] | None = None  # per node: cumulative draft log-prob as one byte (priority-ordered trees)
    more: bool = False  # chain mode: the residual's tail candidates ran out, send more (no nodes)
    # tree rejection sampling: per position (root, then node i) the proposal (ids, weights), () for a leaf
    proposals: list[tuple[tuple[int, ...], tuple[int, ...]]] | None = None
    early: bool = False  # F_EARLY: early results from the exit heads before the reply (trees only)
    ahead: bool = False  # F_AHEAD: the server may decode on past the bonus while its tree budget is 0
    rule: str | None = None  # F_RULE: a registered rule's name (None: the built-in rule the flags say)
    payload: bytes = b""  # F_RULE: that rule's own bytes

    @property
    def rule_name(self) -> str:
        """The verify rule this frame is for: its registered rule, else the built-in one its flags say."""
        return self.rule or ("rejection" if self.q is not None else "tree-rejection" if self.proposals is not None
                             else "match")

    def encode(self) -> bytes:
        n = len(self.tokens)
        flags = (F_CHAIN if self.q is not None else 0) | (F_RESAMPLED if self.resampled is not None else 0) | (
            F_CONF if self.conf is not None else 0) | (F_MORE if self.more else 0) | (
            F_TREEQ if self.proposals is not None else 0) | (F_EARLY if self.early else 0) | (
            F_AHEAD if self.ahead else 0) | (F_RULE if self.rule is not None else 0)
        out = [_REQ_HEAD.pack(MAGIC, VERSION, flags, self.prefix_len, n, min(self.depth, 65535),
                              float(self.draft_ms), float(self.rtt_ms))]
        out.append(struct.pack(f"<{n}I", *self.tokens))
        out.append(struct.pack(f"<{n}h", *self.parents))
        if self.q is not None:
            out.append(struct.pack(f"<{n}f", *self.q))
        if self.conf is not None:
            out.append(bytes(self.conf))
        if self.proposals is not None:
            out.append(encode_proposals(self.proposals, n))
        if self.resampled is not None:
            out.append(struct.pack("<I", self.resampled))
        if self.rule is not None:
            out.append(encode_rule(self.rule, self.payload))
        return b"".join(out)

    @staticmethod
    def header(data: bytes, max_nodes: int = MAX_NODES_WIRE) -> "VerifyHeader":
        """The header alone, checked (magic, version, flags, node limit), body unread: what a router routes on."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidRequest("verify body must be binary")
        if len(data) < _REQ_HEAD.size:
            raise InvalidRequest(f"verify frame too short ({len(data)} bytes)")
        magic, ver, flags, prefix_len, n, depth, draft_ms, rtt_ms = _REQ_HEAD.unpack_from(data)
        if magic != MAGIC or ver != VERSION:
            raise InvalidRequest("not a verify frame of protocol version 1")
        if flags & ~(F_CHAIN | F_RESAMPLED | F_CONF | F_MORE | F_TREEQ | F_EARLY | F_AHEAD | F_RULE):
            raise InvalidRequest(f"unknown flags {flags:#x}")
        rule = flags & (F_CHAIN | F_TREEQ | F_RULE)
        if rule not in _RULE_OPTIONS:
            raise InvalidRequest("flags: one rule a frame (F_CHAIN, F_TREEQ or F_RULE, or none: match)")
        name, options = _RULE_OPTIONS[rule]
        if flags & ~rule & ~options:
            raise InvalidRequest(f"flags {flags & ~rule & ~options:#x} are not options of the {name} rule")
        if any(flags & a and flags & b for a, b in _EXCLUSIVE):
            raise InvalidRequest(f"flags {flags:#x}: F_EARLY, F_AHEAD and F_RESAMPLED exclude each other")
        if flags & F_MORE and (flags & (F_RESAMPLED | F_CONF) or n):
            raise InvalidRequest("flags: F_MORE asks for candidates alone (no nodes, F_RESAMPLED or F_CONF)")
        if n > max_nodes:
            raise PayloadTooLarge(f"tree of {n} nodes exceeds the limit {max_nodes}")
        return VerifyHeader(flags, prefix_len, n, depth, draft_ms, rtt_ms)

    @classmethod
    def decode(cls, data: bytes, max_nodes: int = MAX_NODES_WIRE) -> "VerifyFrame":
        """Parse and structurally check a frame; raises :class:`InvalidRequest` on any defect."""
        h = cls.header(data, max_nodes)
        data = bytes(data)
        flags, prefix_len, n, depth, draft_ms, rtt_ms = h.flags, h.prefix_len, h.nodes, h.depth, h.draft_ms, h.rtt_ms
        chain, has_conf = bool(flags & F_CHAIN), bool(flags & F_CONF)
        want = _REQ_HEAD.size + n * (6 + (4 if chain else 0) + has_conf) + (4 if flags & F_RESAMPLED else 0)
        proposals = None
        if flags & F_TREEQ:
            proposals, extra = decode_proposals(data, want, n)
            want += extra
        rule, payload = None, b""
        if flags & F_RULE:
            rule, payload, size = decode_rule(data, want)
            want += size
        if len(data) != want:
            raise InvalidRequest(f"verify frame is {len(data)} bytes, its header implies {want}")
        off = _REQ_HEAD.size
        tokens = list(struct.unpack_from(f"<{n}I", data, off)); off += 4 * n
        parents = list(struct.unpack_from(f"<{n}h", data, off)); off += 2 * n
        q = None
        if chain:
            q = list(struct.unpack_from(f"<{n}f", data, off)); off += 4 * n
        conf = None
        if has_conf:
            conf = list(data[off: off + n]); off += n
        resampled = struct.unpack_from("<I", data, off)[0] if flags & F_RESAMPLED else None
        for x in (draft_ms, rtt_ms):
            if not (x == x and 0.0 <= x < 1e7):  # NaN or absurd telemetry
                raise InvalidRequest("draft_ms / rtt_ms must be finite and non-negative")
        return cls(prefix_len, tokens, parents, draft_ms, rtt_ms, depth, q, resampled, conf, bool(flags & F_MORE),
                   proposals, bool(flags & F_EARLY), bool(flags & F_AHEAD), rule, payload)


@dataclass
class ReplyFrame:
    accepted: list[int]
    bonus: int | None
    prefix_len: int
    finished: bool = False
    finish_reason: str | None = None
    depth_hint: int = 0  # pacing: draft forwards for the next tree (SpecEdge §4.3)
    budget_hint: int = 0  # load-aware tree budget: nodes for the next tree
    rejected: bool = False  # chain mode: the edge must resample from the residual
    reject_top_ids: list[int] = field(default_factory=list)
    reject_top_probs: list[float] = field(default_factory=list)
    verified: int | None = None  # nodes the server verified when it cut the tree (a prefix); None: all
    tail_mass: float = 0.0  # chain mode, R_TAIL: p's mass outside reject_top_ids
    tail_ids: list[int] = field(default_factory=list)  # i.i.d. samples of p's tail
    tail_probs: list[float] = field(default_factory=list)  # p of each
    ahead: list[int] = field(default_factory=list)  # R_AHEAD: tokens the server decoded past the bonus
    # R_LOGPROBS: per emitted token, in order (tokens() lists them), when the session's sampling asks
    logprobs: list[TokenLogprob] | None = None

    @property
    def emitted(self) -> int:
        """Tokens this reply adds to the prefix: accepted nodes, the bonus, the run-ahead tokens."""
        return len(self.accepted) + (self.bonus is not None) + len(self.ahead)

    def tokens(self, sent: list[int]) -> list[int]:
        """Those tokens, in order, given the tree's tokens as sent."""
        return [sent[i] for i in self.accepted] + ([self.bonus] if self.bonus is not None else []) + self.ahead

    def token_logprobs(self, sent: list[int]) -> list[TokenLogprob] | None:
        """``logprobs`` with their tokens (a decoded frame knows accepted nodes, not their tokens)."""
        if self.logprobs is None:
            return None
        return [replace(lp, token=t) for lp, t in zip(self.logprobs, self.tokens(sent))]

    @property
    def has_tail(self) -> bool:
        return self.tail_mass > 0 or bool(self.tail_ids)

    @classmethod
    def of_tree(cls, res, depth_hint: int, budget_hint: int, tree_nodes: int) -> "ReplyFrame":
        """The reply of a VerifyResult for a tree of ``tree_nodes`` nodes (``verified``: only if the server cut it)."""
        return cls(list(res.accepted), res.bonus, res.prefix_len, res.finished, res.finish_reason, depth_hint,
                   budget_hint, verified=res.verified if res.verified < tree_nodes else None,
                   logprobs=list(res.logprobs) if res.logprobs is not None else None)

    @classmethod
    def of_run(cls, accepted: list[int], tokens: list[int], last, verified: int | None, depth_hint: int,
               budget_hint: int) -> "ReplyFrame":
        """A run-ahead reply: the request's ``accepted`` nodes, ``tokens`` (the bonus, then those decoded
        past it), the prefix and finish state of the ``last`` round."""
        return cls(list(accepted), tokens[0] if tokens else None, last.prefix_len, last.finished, last.finish_reason,
                   depth_hint, budget_hint, verified=verified, ahead=list(tokens[1:]))

    @classmethod
    def of_chain(cls, res, depth_hint: int, budget_hint: int) -> "ReplyFrame":
        """The reply of a :class:`~specdec.engine.ChainVerifyResult`."""
        rejected = res.bonus is None and not res.finished
        return cls(list(range(res.num_accepted)), res.bonus, res.prefix_len, res.finished, res.finish_reason,
                   depth_hint, budget_hint, rejected, list(res.reject_top_ids), list(res.reject_top_probs),
                   None, res.tail_mass, list(res.tail_ids), list(res.tail_probs))

    def encode(self) -> bytes:
        flags = (R_FINISHED if self.finished else 0) | (R_HAS_BONUS if self.bonus is not None else 0) | (
            R_REJECTED if self.rejected else 0) | (R_TRUNCATED if self.verified is not None else 0) | (
            R_TAIL if self.has_tail else 0) | (R_AHEAD if self.ahead else 0) | (
            R_LOGPROBS if self.logprobs is not None else 0)
        k = len(self.reject_top_ids)
        head = _REP_HEAD.pack(MAGIC, VERSION, flags, FINISH_CODES[self.finish_reason], 0, len(self.accepted),
                              self.prefix_len, self.bonus or 0, min(self.depth_hint, 255),
                              min(self.budget_hint, 65535), k)
        tail = struct.pack("<H", self.verified) if self.verified is not None else b""
        if self.has_tail:
            m = len(self.tail_ids)
            tail += _TAIL_HEAD.pack(self.tail_mass, m) + struct.pack(f"<{m}I", *self.tail_ids) + struct.pack(
                f"<{m}f", *self.tail_probs)
        if self.ahead:
            tail += struct.pack(f"<H{len(self.ahead)}I", len(self.ahead), *self.ahead)
        if self.logprobs is not None:
            tail += _encode_logprobs(self.logprobs)
        return b"".join([head, struct.pack(f"<{len(self.accepted)}H", *self.accepted),
                         struct.pack(f"<{k}I", *self.reject_top_ids), struct.pack(f"<{k}f", *self.reject_top_probs),
                         tail])

    @staticmethod
    def outcome(data: bytes) -> "ReplyOutcome":
        """What a reply adds and whether it finished, from its header and section counts (what a router accounts by)."""
        if len(data) < _REP_HEAD.size:
            raise InvalidRequest("reply frame too short")
        magic, ver, flags, _, _, n, _, _, _, _, k = _REP_HEAD.unpack_from(data)
        if magic != MAGIC or ver != VERSION:
            raise InvalidRequest("malformed reply frame")
        off = _REP_HEAD.size + 2 * n + 8 * k + 2 * bool(flags & R_TRUNCATED)
        if flags & R_TAIL:
            if len(data) < off + _TAIL_HEAD.size:
                raise InvalidRequest("malformed reply frame")
            off += _TAIL_HEAD.size + 8 * _TAIL_HEAD.unpack_from(data, off)[1]
        ahead = 0
        if flags & R_AHEAD:
            if len(data) < off + 2:
                raise InvalidRequest("malformed reply frame")
            (ahead,) = struct.unpack_from("<H", data, off)
        return ReplyOutcome(n + bool(flags & R_HAS_BONUS) + ahead, bool(flags & R_FINISHED))

    @classmethod
    def decode(cls, data: bytes) -> "ReplyFrame":
        if len(data) < _REP_HEAD.size:
            raise InvalidRequest("reply frame too short")
        magic, ver, flags, fin, _, n, prefix_len, bonus, depth, budget, k = _REP_HEAD.unpack_from(data)
        truncated, has_tail, has_ahead = bool(flags & R_TRUNCATED), bool(flags & R_TAIL), bool(flags & R_AHEAD)
        size = _REP_HEAD.size + 2 * n + 8 * k + 2 * truncated
        if magic != MAGIC or ver != VERSION or flags & ~(R_FINISHED | R_HAS_BONUS | R_REJECTED | R_TRUNCATED | R_TAIL
                                                         | R_AHEAD | R_LOGPROBS):
            raise InvalidRequest("malformed reply frame")
        mass, m = _TAIL_HEAD.unpack_from(data, size) if has_tail and len(data) >= size + _TAIL_HEAD.size else (0.0, 0)
        size += _TAIL_HEAD.size + 8 * m if has_tail else 0
        (a,) = struct.unpack_from("<H", data, size) if has_ahead and len(data) >= size + 2 else (0,)
        end = size + (2 + 4 * a if has_ahead else 0)  # where R_LOGPROBS begins
        if (len(data) != end if not flags & R_LOGPROBS else len(data) < end) or has_ahead and not (
                a and flags & R_HAS_BONUS):
            raise InvalidRequest("malformed reply frame")
        off = _REP_HEAD.size
        acc = list(struct.unpack_from(f"<{n}H", data, off)); off += 2 * n
        ids = list(struct.unpack_from(f"<{k}I", data, off)); off += 4 * k
        probs = list(struct.unpack_from(f"<{k}f", data, off)); off += 4 * k
        verified = struct.unpack_from("<H", data, off)[0] if truncated else None
        off += 2 * truncated + _TAIL_HEAD.size * has_tail
        tail_ids = list(struct.unpack_from(f"<{m}I", data, off)); off += 4 * m
        tail_probs = list(struct.unpack_from(f"<{m}f", data, off)); off += 4 * m
        ahead = list(struct.unpack_from(f"<{a}I", data, off + 2)) if has_ahead else []
        out = cls(acc, bonus if flags & R_HAS_BONUS else None, prefix_len, bool(flags & R_FINISHED),
                  FINISH_NAMES.get(fin), depth, budget, bool(flags & R_REJECTED), ids, probs, verified,
                  mass, tail_ids, tail_probs, ahead)
        if flags & R_LOGPROBS:  # its tokens: the accepted nodes' (unknown here: -1), the bonus, the run-ahead
            out.logprobs = _decode_logprobs(data, end, [-1] * n + ([bonus] if flags & R_HAS_BONUS else []) + ahead)
        return out


@dataclass(frozen=True)
class ReplyOutcome:
    """A reply's effect on its session (:meth:`ReplyFrame.outcome`)."""

    emitted: int
    finished: bool


@dataclass
class EarlyFrame:
    """An exit layer's guess of the round in flight (``F_EARLY``): accepted node indices of the
    tree sent, the next token, the exit's probability of both; ``prefix_len`` = the tree's."""

    prefix_len: int
    layer: int
    accepted: list[int]
    token: int
    confidence: float

    def encode(self) -> bytes:
        n = len(self.accepted)
        return _EARLY_HEAD.pack(EARLY_MAGIC, VERSION, 0, self.prefix_len, self.layer, n, self.token,
                                float(self.confidence)) + struct.pack(f"<{n}H", *self.accepted)

    @staticmethod
    def is_early(data: bytes) -> bool:
        return len(data) >= 2 and struct.unpack_from("<H", data)[0] == EARLY_MAGIC

    @classmethod
    def decode(cls, data: bytes) -> "EarlyFrame":
        if len(data) < _EARLY_HEAD.size:
            raise InvalidRequest("early frame too short")
        magic, ver, flags, prefix_len, layer, n, token, conf = _EARLY_HEAD.unpack_from(data)
        if magic != EARLY_MAGIC or ver != VERSION or flags or len(data) != _EARLY_HEAD.size + 2 * n:
            raise InvalidRequest("malformed early frame")
        if not (0.0 <= conf <= 1.0):
            raise InvalidRequest("early frame confidence outside [0, 1]")
        return cls(prefix_len, layer, list(struct.unpack_from(f"<{n}H", data, _EARLY_HEAD.size)), token, conf)


EARLY_STREAM_MEDIA_TYPE = "application/x-specedge-frames"  # POST verify: early frames, then the reply
_RECORD = struct.Struct("<I")


def asks_early(data: bytes) -> bool:
    """Whether a verify frame's header has ``F_EARLY`` (no other check: :meth:`VerifyFrame.decode` does them)."""
    if len(data) < _REQ_HEAD.size:
        return False
    magic, ver, flags = _REQ_HEAD.unpack_from(data)[:3]
    return magic == MAGIC and ver == VERSION and bool(flags & F_EARLY)


def record(message: bytes) -> bytes:
    """One record of a streamed verify response: u32 length, then the message."""
    return _RECORD.pack(len(message)) + message


class RecordReader:
    """Splits a streamed verify response, fed in arbitrary chunks, back into its messages."""

    def __init__(self, max_message: int = 1 << 22):
        self.buf, self.max_message = bytearray(), max_message

    def feed(self, chunk: bytes) -> list[bytes]:
        self.buf += chunk
        out = []
        while len(self.buf) >= _RECORD.size:
            (n,) = _RECORD.unpack_from(self.buf)
            if n > self.max_message:
                raise InvalidRequest(f"streamed record of {n} bytes exceeds {self.max_message}")
            if len(self.buf) < _RECORD.size + n:
                break
            out.append(bytes(self.buf[_RECORD.size: _RECORD.size + n]))
            del self.buf[: _RECORD.size + n]
        return out

    @property
    def pending(self) -> int:
        """Bytes of an incomplete record (non-zero when the stream ends: it was cut)."""
        return len(self.buf)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ClientInfo(_Body):
    tokenizer_fingerprint: str | None = None
    draft_ms: float = Field(0.0, ge=0, le=1e6)
    rtt_ms: float = Field(0.0, ge=0, le=1e6)
    agent: str | None = Field(None, max_length=128)
    draft: str | None = Field(None, max_length=128,
                              description="the edge's draft and how it builds trees (the agent sends "
                                          "'<draft>/<mode>/<depth policy>'): sessions naming the same draft "
                                          "share acceptance estimates in the replica's pacing (Acceptance classes "
                                          "above); absent: the version's shared estimates")
    run_ahead: bool = Field(False, description="the session's first request carries F_AHEAD when the open's "
                                               "budget hint is 0: the replica may decode on from the first token "
                                               "at once (Run-ahead above)")


class OpenSession(_Body):
    prompt_ids: list[int] = Field(..., min_length=1)
    generated_ids: list[int] = Field(default_factory=list)
    sampling: dict = Field(default_factory=dict)
    mode: str = Field("tree", pattern="^(tree|chain)$")
    client: ClientInfo = Field(default_factory=ClientInfo)
    model: str | None = Field(None, max_length=128, description="the target version (a name of target.adapters); "
                                                                "absent, 'base' or the base's name: the base")
    close_on_finish: bool = Field(False, description="the server closes the session with the reply that "
                                                     "finishes it: no close request needed")
    grammar: dict | None = Field(None, description="structured output: {kind, value} (specdec/grammar.py)")


class SessionOpened(_Body):
    session_id: str
    first_token: int | None
    first_logprob: dict | None = None  # TokenLogprob.to_dict() of the first token, when the sampling asks
    prefix_len: int
    cached_tokens: int = 0  # of the prompt + history, found in the server's prefix cache (not computed)
    finished: bool
    finish_reason: str | None = None
    depth_hint: int
    budget_hint: int
    tokenizer_fingerprint: str
    model: str
    close_on_finish: bool = False  # the server honours the open's close_on_finish: it closes the session itself
