"""The variable sections of a verify frame: proposals (``F_TREEQ``) and a registered rule's payload (``F_RULE``)."""

from __future__ import annotations

import struct

from specdec.errors import InvalidRequest

RULE_HEAD = struct.Struct("<BI")  # F_RULE: name length, payload length; then the name (ASCII), the payload


def encode_proposals(proposals, n: int) -> bytes:
    """``F_TREEQ``'s bytes: counts (u8 per position), ids (u32), weights (u16)."""
    if len(proposals) != n + 1:
        raise ValueError(f"{len(proposals)} proposals for {n} nodes (one per node + the root)")
    props = [(tuple(p[0]), tuple(p[1])) if p else ((), ()) for p in proposals]
    ids = [x for p in props for x in p[0]]
    ws = [w for p in props for w in p[1]]
    return bytes(len(p[0]) for p in props) + struct.pack(f"<{len(ids)}I", *ids) + struct.pack(f"<{len(ws)}H", *ws)


def decode_proposals(data: bytes, off: int, n: int):
    """The proposals at ``off`` (before an F_RESAMPLED tail, which F_TREEQ never has) and their size."""
    if len(data) < off + n + 1:
        raise InvalidRequest("verify frame too short for its proposals")
    counts = list(data[off: off + n + 1])
    e = sum(counts)
    if len(data) < off + n + 1 + 6 * e:
        raise InvalidRequest("verify frame too short for its proposals")
    ids = struct.unpack_from(f"<{e}I", data, off + n + 1)
    ws = struct.unpack_from(f"<{e}H", data, off + n + 1 + 4 * e)
    out, j = [], 0
    for c in counts:
        out.append((tuple(ids[j: j + c]), tuple(ws[j: j + c])))
        j += c
    return out, n + 1 + 6 * e


def encode_rule(name: str, payload: bytes) -> bytes:
    """``F_RULE``'s bytes."""
    raw = name.encode("ascii")
    return RULE_HEAD.pack(len(raw), len(payload)) + raw + bytes(payload)


def decode_rule(data: bytes, off: int) -> tuple[str, bytes, int]:
    """``F_RULE``'s name and payload at ``off``, and their size."""
    if len(data) < off + RULE_HEAD.size:
        raise InvalidRequest("flags: F_RULE, but no rule name and payload follow")
    k, m = RULE_HEAD.unpack_from(data, off)
    name = data[off + RULE_HEAD.size: off + RULE_HEAD.size + k]
    if not k or len(name) != k or not name.isascii():
        raise InvalidRequest("flags: F_RULE's name must be 1-255 ASCII bytes")
    start = off + RULE_HEAD.size + k
    payload = data[start: start + m]
    return name.decode("ascii"), payload, start + len(payload) - off
