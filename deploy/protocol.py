"""The edge <-> cloud protocol: JSON for session control, compact binary for verify.

HTTP (all under ``/v1``, ``Authorization: Bearer <tenant key>``):

- ``GET  /v1/health``; ``GET /v1/model`` -> name, vocab size, eos ids, tokenizer
  fingerprint, tree limits.
- ``POST /v1/sessions`` JSON :class:`OpenSession` -> JSON :class:`SessionOpened`.
  With ``generated_ids`` it re-opens an evicted/lost session from the edge's history.
- ``POST /v1/sessions/{id}/verify`` binary :class:`VerifyFrame` -> binary
  :class:`ReplyFrame` (``application/octet-stream``); errors are JSON 4xx.
- ``WS   /v1/sessions/{id}/ws``: the same binary frames, one reply per request, so a
  round costs one RTT on a warm connection; an error arrives as a JSON text frame.
- ``DELETE /v1/sessions/{id}``.

Uplink is 20 bytes + 6 bytes per draft node (token u32, parent i16); downlink 24 bytes
+ 2 bytes per accepted node: DSSD/PicoSpec's "token ids only" goal by construction.
Trees go in priority order (every prefix of the node list is a tree) and may carry one
confidence byte per node (``F_CONF``: the node's cumulative draft log-probability,
:func:`deploy.verifier.truncation.encode_confidence`), 7 bytes per node in all: the server
verifies the prefix that pays off for the batch at hand and, when it cut the tree, says how
many nodes it verified (``R_TRUNCATED`` + u16). Chain mode (DSSD rejection sampling) adds
q(x) as f32 per node uplink and, on a rejection only, the top-K target distribution downlink.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from deploy.errors import InvalidRequest, PayloadTooLarge

MAGIC = 0x5345  # "SE"
VERSION = 1
MAX_NODES_WIRE = 4096

_REQ_HEAD = struct.Struct("<HBBIHHff")  # magic, version, flags, prefix_len, n, depth_hint, draft_ms, rtt_ms
_REP_HEAD = struct.Struct("<HBBBBHIIBxHI")  # magic, ver, flags, finish, _, n_acc, prefix_len, bonus, depth, budget, K

F_CHAIN, F_RESAMPLED, F_CONF = 1, 2, 4  # request flags
R_FINISHED, R_HAS_BONUS, R_REJECTED, R_TRUNCATED = 1, 2, 4, 8  # reply flags
FINISH_CODES = {None: 0, "stop": 1, "length": 2}
FINISH_NAMES = {v: k for k, v in FINISH_CODES.items()}


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

    def encode(self) -> bytes:
        n = len(self.tokens)
        flags = (F_CHAIN if self.q is not None else 0) | (F_RESAMPLED if self.resampled is not None else 0) | (
            F_CONF if self.conf is not None else 0)
        out = [_REQ_HEAD.pack(MAGIC, VERSION, flags, self.prefix_len, n, min(self.depth, 65535),
                              float(self.draft_ms), float(self.rtt_ms))]
        out.append(struct.pack(f"<{n}I", *self.tokens))
        out.append(struct.pack(f"<{n}h", *self.parents))
        if self.q is not None:
            out.append(struct.pack(f"<{n}f", *self.q))
        if self.conf is not None:
            out.append(bytes(self.conf))
        if self.resampled is not None:
            out.append(struct.pack("<I", self.resampled))
        return b"".join(out)

    @classmethod
    def decode(cls, data: bytes, max_nodes: int = MAX_NODES_WIRE) -> "VerifyFrame":
        """Parse and structurally check a frame; raises :class:`InvalidRequest` on any defect."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidRequest("verify body must be binary")
        data = bytes(data)
        if len(data) < _REQ_HEAD.size:
            raise InvalidRequest(f"verify frame too short ({len(data)} bytes)")
        magic, ver, flags, prefix_len, n, depth, draft_ms, rtt_ms = _REQ_HEAD.unpack_from(data)
        if magic != MAGIC or ver != VERSION:
            raise InvalidRequest("not a verify frame of protocol version 1")
        if flags & ~(F_CHAIN | F_RESAMPLED | F_CONF):
            raise InvalidRequest(f"unknown flags {flags:#x}")
        if n > max_nodes:
            raise PayloadTooLarge(f"tree of {n} nodes exceeds the limit {max_nodes}")
        chain, has_conf = bool(flags & F_CHAIN), bool(flags & F_CONF)
        want = _REQ_HEAD.size + n * (6 + (4 if chain else 0) + has_conf) + (4 if flags & F_RESAMPLED else 0)
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
        return cls(prefix_len, tokens, parents, draft_ms, rtt_ms, depth, q, resampled, conf)


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

    def encode(self) -> bytes:
        flags = (R_FINISHED if self.finished else 0) | (R_HAS_BONUS if self.bonus is not None else 0) | (
            R_REJECTED if self.rejected else 0) | (R_TRUNCATED if self.verified is not None else 0)
        k = len(self.reject_top_ids)
        head = _REP_HEAD.pack(MAGIC, VERSION, flags, FINISH_CODES[self.finish_reason], 0, len(self.accepted),
                              self.prefix_len, self.bonus or 0, min(self.depth_hint, 255),
                              min(self.budget_hint, 65535), k)
        tail = struct.pack("<H", self.verified) if self.verified is not None else b""
        return b"".join([head, struct.pack(f"<{len(self.accepted)}H", *self.accepted),
                         struct.pack(f"<{k}I", *self.reject_top_ids), struct.pack(f"<{k}f", *self.reject_top_probs),
                         tail])

    @classmethod
    def decode(cls, data: bytes) -> "ReplyFrame":
        if len(data) < _REP_HEAD.size:
            raise InvalidRequest("reply frame too short")
        magic, ver, flags, fin, _, n, prefix_len, bonus, depth, budget, k = _REP_HEAD.unpack_from(data)
        truncated = bool(flags & R_TRUNCATED)
        if magic != MAGIC or ver != VERSION or len(data) != _REP_HEAD.size + 2 * n + 8 * k + 2 * truncated:
            raise InvalidRequest("malformed reply frame")
        off = _REP_HEAD.size
        acc = list(struct.unpack_from(f"<{n}H", data, off)); off += 2 * n
        ids = list(struct.unpack_from(f"<{k}I", data, off)); off += 4 * k
        probs = list(struct.unpack_from(f"<{k}f", data, off)); off += 4 * k
        verified = struct.unpack_from("<H", data, off)[0] if truncated else None
        return cls(acc, bonus if flags & R_HAS_BONUS else None, prefix_len, bool(flags & R_FINISHED),
                   FINISH_NAMES.get(fin), depth, budget, bool(flags & R_REJECTED), ids, probs, verified)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ClientInfo(_Body):
    tokenizer_fingerprint: str | None = None
    draft_ms: float = Field(0.0, ge=0, le=1e6)
    rtt_ms: float = Field(0.0, ge=0, le=1e6)
    agent: str | None = Field(None, max_length=128)


class OpenSession(_Body):
    prompt_ids: list[int] = Field(..., min_length=1)
    generated_ids: list[int] = Field(default_factory=list)
    sampling: dict = Field(default_factory=dict)
    mode: str = Field("tree", pattern="^(tree|chain)$")
    client: ClientInfo = Field(default_factory=ClientInfo)


class SessionOpened(_Body):
    session_id: str
    first_token: int | None
    prefix_len: int
    finished: bool
    finish_reason: str | None = None
    depth_hint: int
    budget_hint: int
    tokenizer_fingerprint: str
    model: str
