"""Wire protocol: binary VerifyFrame / ReplyFrame round trips and a decoder fuzz (any bytes give
a typed 4xx error, never another exception); JSON session bodies."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from specdec.errors import InvalidRequest, PayloadTooLarge
from specdec.protocol import (F_AHEAD, F_CHAIN, F_CONF, F_EARLY, F_MORE, F_RESAMPLED, F_TREEQ, MAGIC,
                             MAX_NODES_WIRE, R_AHEAD, R_HAS_BONUS, VERSION, EarlyFrame, OpenSession, RecordReader, ReplyFrame, SessionOpened, VerifyFrame,
                             asks_early, record)

f32 = st.floats(0, 1e6, allow_nan=False, width=32)


@st.composite
def verify_frames(draw) -> VerifyFrame:
    if draw(st.integers(0, 7)) == 0:  # chain mode: more residual candidates, please
        return VerifyFrame(prefix_len=draw(st.integers(0, 2**32 - 1)), tokens=[], parents=[], q=[], more=True,
                           draft_ms=draw(f32), rtt_ms=draw(f32))
    n = draw(st.integers(0, 24))
    chain = draw(st.booleans())
    resampled = draw(st.none() | st.integers(0, 2**32 - 1))
    return VerifyFrame(
        prefix_len=draw(st.integers(0, 2**32 - 1)),
        tokens=draw(st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n)),
        parents=draw(st.lists(st.integers(-(2**15), 2**15 - 1), min_size=n, max_size=n)),
        draft_ms=draw(f32), rtt_ms=draw(f32), depth=draw(st.integers(0, 65535)),
        q=draw(st.lists(st.floats(0, 1, width=32), min_size=n, max_size=n)) if chain else None,
        resampled=resampled, ahead=not chain and resampled is None and draw(st.booleans()),
    )


@settings(max_examples=150, deadline=None)
@given(verify_frames())
def test_verify_frame_round_trip(frame):
    data = frame.encode()
    assert len(data) == 20 + 6 * len(frame.tokens) + (4 * len(frame.tokens) if frame.q is not None else 0) + (
        4 if frame.resampled is not None else 0)
    assert VerifyFrame.decode(data) == frame


def test_uplink_size_is_a_few_bytes_per_node():
    frame = VerifyFrame(prefix_len=100, tokens=list(range(32)), parents=[-1] + list(range(31)))
    assert len(frame.encode()) == 20 + 6 * 32


@st.composite
def reply_frames(draw) -> ReplyFrame:
    k = draw(st.integers(0, 16))
    m = draw(st.integers(0, 16))
    bonus = draw(st.none() | st.integers(0, 2**32 - 1))
    return ReplyFrame(
        accepted=draw(st.lists(st.integers(0, 65535), max_size=24)),
        bonus=bonus,
        prefix_len=draw(st.integers(0, 2**32 - 1)),
        finished=draw(st.booleans()), finish_reason=draw(st.sampled_from([None, "stop", "length"])),
        depth_hint=draw(st.integers(0, 255)), budget_hint=draw(st.integers(0, 65535)),
        rejected=draw(st.booleans()),
        reject_top_ids=draw(st.lists(st.integers(0, 2**32 - 1), min_size=k, max_size=k)),
        reject_top_probs=draw(st.lists(st.floats(0, 1, width=32), min_size=k, max_size=k)),
        verified=draw(st.none() | st.integers(0, 65535)),
        tail_mass=draw(st.just(0.0) | st.floats(0.5, 1, width=32)),
        tail_ids=draw(st.lists(st.integers(0, 2**32 - 1), min_size=m, max_size=m)),
        tail_probs=draw(st.lists(st.floats(0, 1, width=32), min_size=m, max_size=m)),
        ahead=draw(st.lists(st.integers(0, 2**32 - 1), max_size=9)) if bonus is not None else [],
    )


@settings(max_examples=150, deadline=None)
@given(reply_frames())
def test_reply_frame_round_trip(frame):
    assert ReplyFrame.decode(frame.encode()) == frame


def decode_or_typed_error(data: bytes) -> None:
    try:
        frame = VerifyFrame.decode(data)
    except (InvalidRequest, PayloadTooLarge) as e:
        assert 400 <= e.status < 500 and e.message
        return
    # whatever decodes is well formed and encodes back to the same bytes
    assert len(frame.tokens) == len(frame.parents) <= MAX_NODES_WIRE
    assert frame.encode() == data


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=300))
def test_decoder_fuzz_arbitrary_bytes(data):
    decode_or_typed_error(data)


@settings(max_examples=400, deadline=None)
@given(verify_frames(), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4),
       st.integers(-8, 8))
def test_decoder_fuzz_mutated_valid_frames(frame, flips, resize):
    """Valid headers with corrupted bytes and wrong lengths reach the decoder's deeper checks."""
    data = bytearray(frame.encode())
    for pos, byte in flips:
        data[pos % len(data)] = byte
    if resize > 0:
        data += bytes(resize)
    elif resize < 0:
        del data[resize:]
    decode_or_typed_error(bytes(data))


def head(n: int, flags: int = 0, magic: int = MAGIC, version: int = VERSION, draft_ms: float = 1.0) -> bytes:
    return struct.pack("<HBBIHHff", magic, version, flags, 10, n, 0, draft_ms, 0.0)


@pytest.mark.parametrize("data, err, fragment", [
    (b"", InvalidRequest, "too short"),
    (head(0)[:-1], InvalidRequest, "too short"),
    (head(0, magic=0x1234), InvalidRequest, "protocol"),
    (head(0, version=2), InvalidRequest, "protocol"),
    (head(0, flags=128), InvalidRequest, "flags"),
    (head(0, flags=F_TREEQ | F_CHAIN) + b"\0", InvalidRequest, "flags"),  # proposals go with trees only
    (head(0, flags=F_TREEQ), InvalidRequest, "proposals"),  # no count byte for the root
    (head(0, flags=F_TREEQ) + b"\2" + bytes(6), InvalidRequest, "proposals"),  # 2 entries announced, 1 sent
    (head(0, flags=F_MORE), InvalidRequest, "flags"),  # F_MORE only with F_CHAIN, alone, no nodes
    (head(0, flags=F_MORE | F_CHAIN | F_RESAMPLED) + bytes(4), InvalidRequest, "flags"),
    (head(0, flags=F_MORE | F_CHAIN | F_CONF), InvalidRequest, "flags"),
    (head(1, flags=F_MORE | F_CHAIN) + bytes(10), InvalidRequest, "flags"),
    (head(1), InvalidRequest, "implies"),  # header says 1 node, no body
    (head(0) + b"\0", InvalidRequest, "implies"),
    (head(MAX_NODES_WIRE + 1), PayloadTooLarge, "limit"),
    (head(0, draft_ms=float("nan")), InvalidRequest, "finite"),
    (head(0, draft_ms=float("inf")), InvalidRequest, "finite"),
    (head(0, draft_ms=-1.0), InvalidRequest, "non-negative"),
])
def test_decoder_rejections(data, err, fragment):
    with pytest.raises(err) as e:
        VerifyFrame.decode(data)
    assert fragment in e.value.message
    assert type(e.value) is err  # the exact class, so the router maps it to the right status


def test_decoder_rejects_non_bytes_and_oversized_trees_by_limit():
    with pytest.raises(InvalidRequest):
        VerifyFrame.decode("not bytes")  # type: ignore[arg-type]
    frame = VerifyFrame(prefix_len=1, tokens=[1] * 10, parents=[-1] * 10)
    with pytest.raises(PayloadTooLarge):
        VerifyFrame.decode(frame.encode(), max_nodes=9)
    assert VerifyFrame.decode(memoryview(frame.encode())) == frame


def test_reply_decoder_rejects_malformed_frames():
    good = ReplyFrame(accepted=[1, 2], bonus=5, prefix_len=9).encode()
    tail = ReplyFrame(accepted=[0], bonus=None, prefix_len=9, rejected=True, reject_top_ids=[3],
                      reject_top_probs=[0.5], tail_mass=0.5, tail_ids=[7, 8], tail_probs=[0.1, 0.2]).encode()
    unknown_flag = good[:3] + bytes([good[3] | 64]) + good[4:]
    ahead = ReplyFrame(accepted=[1], bonus=5, prefix_len=9, ahead=[6, 7]).encode()
    no_bonus = ahead[:3] + bytes([ahead[3] & ~R_HAS_BONUS]) + ahead[4:]
    flag_only = good[:3] + bytes([good[3] | R_AHEAD]) + good[4:]  # R_AHEAD, no count
    zero = flag_only + struct.pack("<H", 0)  # R_AHEAD with no tokens
    for bad in (b"", good[:-1], good + b"\0", b"\0\0" + good[2:], unknown_flag, tail[:-1], tail + b"\0",
                tail[:-16], ahead[:-1], ahead + b"\0", ahead[:-4], no_bonus, flag_only, zero):
        with pytest.raises(InvalidRequest):
            ReplyFrame.decode(bad)


def test_chain_wire_sizes():
    """Issue 17: chain uplink 10 bytes per draft token (+4 for an owed token); a rejection's
    downlink is 24 + 2 per accepted + 8 per head entry, + 6 + 8 per tail candidate."""
    up = VerifyFrame(prefix_len=50, tokens=[1, 2, 3], parents=[-1, 0, 1], q=[0.5, 0.25, 1.0], resampled=7)
    assert len(up.encode()) == 20 + 10 * 3 + 4 and VerifyFrame.decode(up.encode()) == up
    more = VerifyFrame(prefix_len=51, tokens=[], parents=[], q=[], more=True)
    assert len(more.encode()) == 20 and VerifyFrame.decode(more.encode()) == more
    whole = ReplyFrame(accepted=[0, 1], bonus=None, prefix_len=53, rejected=True, reject_top_ids=[4, 5, 6],
                       reject_top_probs=[0.5, 0.25, 0.25])
    assert len(whole.encode()) == 24 + 2 * 2 + 8 * 3
    split = ReplyFrame(accepted=[], bonus=None, prefix_len=51, rejected=True, reject_top_ids=[4],
                       reject_top_probs=[0.5], tail_mass=0.5, tail_ids=[9, 10], tail_probs=[0.125, 0.0625])
    assert len(split.encode()) == 24 + 8 + 6 + 8 * 2 and ReplyFrame.decode(split.encode()) == split


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_tree_rejection_frames_round_trip(data):
    """Issue 17, F_TREEQ: per position a proposal (ids u32, weights u16); 6 bytes per node, 1 per
    position, 6 per proposal entry."""
    n = data.draw(st.integers(0, 12))
    props = [data.draw(st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 65535)), max_size=5))
             for _ in range(n + 1)]
    frame = VerifyFrame(prefix_len=9, tokens=list(range(n)), parents=[-1] * n,
                        proposals=[(tuple(i for i, _ in p), tuple(w for _, w in p)) for p in props],
                        conf=[3] * n if data.draw(st.booleans()) else None)
    enc = frame.encode()
    assert len(enc) == 20 + 6 * n + (n if frame.conf else 0) + n + 1 + 6 * sum(len(p) for p in props)
    assert VerifyFrame.decode(enc) == frame


@given(st.lists(st.integers(0, 65535), max_size=40), st.integers(0, 2**32 - 1), st.floats(0, 1, width=32),
       st.integers(0, 65535), st.integers(0, 2**32 - 1))
def test_early_frames_round_trip(accepted, token, conf, layer, prefix_len):
    """Issue 19: 20 bytes + 2 per accepted node, its own magic (never mistaken for a reply)."""
    f = EarlyFrame(prefix_len, layer, accepted, token, conf)
    enc = f.encode()
    assert len(enc) == 20 + 2 * len(accepted) and EarlyFrame.is_early(enc)
    assert EarlyFrame.decode(enc) == f
    assert not EarlyFrame.is_early(ReplyFrame([1], 2, 3).encode())
    with pytest.raises(InvalidRequest):
        ReplyFrame.decode(enc)
    for bad in (enc[:-1] if accepted else enc[:10], enc + b"\0\0", enc[:2] + b"\x07" + enc[3:]):
        with pytest.raises(InvalidRequest):
            EarlyFrame.decode(bad)


def test_the_early_flag_goes_with_plain_trees_only():
    tree = VerifyFrame(prefix_len=4, tokens=[5, 6], parents=[-1, 0], early=True)
    assert VerifyFrame.decode(tree.encode()).early and tree.encode()[3] & F_EARLY
    assert not VerifyFrame.decode(VerifyFrame(prefix_len=4, tokens=[5], parents=[-1]).encode()).early
    for other in (F_CHAIN, F_MORE, F_TREEQ, F_RESAMPLED):
        raw = bytearray(tree.encode())
        raw[3] |= other
        with pytest.raises(InvalidRequest, match="F_EARLY|flags|bytes"):
            VerifyFrame.decode(bytes(raw))
    bad_conf = EarlyFrame(4, 1, [0], 5, 0.5).encode()[:-6] + struct.pack("<f", 1.5) + b"\0\0"
    with pytest.raises(InvalidRequest):
        EarlyFrame.decode(bad_conf)


def test_the_ahead_flag_goes_with_plain_trees_only():
    """F_AHEAD (run-ahead): a plain tree or an empty one, with confidences or not; nothing else."""
    for frame in (VerifyFrame(prefix_len=4, tokens=[], parents=[], ahead=True),
                  VerifyFrame(prefix_len=4, tokens=[5, 6], parents=[-1, 0], conf=[0, 3], ahead=True)):
        data = frame.encode()
        assert data[3] & F_AHEAD and VerifyFrame.decode(data) == frame
        assert len(data) == len(VerifyFrame(prefix_len=4, tokens=frame.tokens, parents=frame.parents,
                                            conf=frame.conf).encode())  # one flag bit, no bytes
        for other in (F_CHAIN, F_MORE, F_TREEQ, F_RESAMPLED, F_EARLY):
            raw = bytearray(data)
            raw[3] |= other
            with pytest.raises(InvalidRequest, match="F_AHEAD|F_EARLY|flags|bytes|proposals"):
                VerifyFrame.decode(bytes(raw))
    reply = ReplyFrame(accepted=[0, 1], bonus=7, prefix_len=20, ahead=[8, 9, 10])
    assert reply.emitted == 6 and ReplyFrame.decode(reply.encode()).ahead == [8, 9, 10]
    assert len(reply.encode()) == len(ReplyFrame(accepted=[0, 1], bonus=7, prefix_len=20).encode()) + 2 + 4 * 3


@settings(max_examples=60)
@given(st.lists(st.binary(max_size=70), max_size=8), st.lists(st.integers(1, 40), min_size=1, max_size=20))
def test_streamed_records_split_back_into_messages_whatever_the_chunks(messages, cuts):
    """Issue 19, POST verify streamed: u32-length records survive any chunking on the way."""
    data = b"".join(record(m) for m in messages)
    reader, got, i, k = RecordReader(), [], 0, 0
    while i < len(data):
        step = cuts[k % len(cuts)]
        got += reader.feed(data[i: i + step])
        i, k = i + step, k + 1
    assert got == messages and reader.pending == 0
    if data:
        cut = RecordReader()
        assert cut.feed(data[:-1]) == messages[:-1] and cut.pending > 0  # a cut stream leaves bytes pending
    with pytest.raises(InvalidRequest):
        RecordReader(max_message=8).feed(record(b"x" * 9))


def test_asks_early_reads_the_flag_only():
    assert asks_early(VerifyFrame(prefix_len=4, tokens=[5], parents=[-1], early=True).encode())
    assert not asks_early(VerifyFrame(prefix_len=4, tokens=[5], parents=[-1]).encode())
    assert not asks_early(b"") and not asks_early(b"\xff" * 40)


def test_json_bodies_validate():
    o = OpenSession(prompt_ids=[1, 2], sampling={"temperature": 0.5})
    assert o.mode == "tree" and o.client.draft_ms == 0.0 and o.generated_ids == []
    for bad in ({"prompt_ids": []}, {"prompt_ids": [1], "mode": "beam"}, {"prompt_ids": [1], "extra": 1},
                {"prompt_ids": [1], "client": {"rtt_ms": -1}}, {"prompt_ids": [1], "client": {"agent": "x" * 129}}):
        with pytest.raises(ValidationError):
            OpenSession(**bad)
    s = SessionOpened(session_id="s", first_token=3, prefix_len=4, finished=False, depth_hint=4, budget_hint=32,
                      tokenizer_fingerprint="abc", model="m")
    assert SessionOpened.model_validate_json(s.model_dump_json()) == s


def test_a_tree_reply_says_verified_only_when_the_server_cut_the_tree():
    from types import SimpleNamespace

    res = SimpleNamespace(accepted=[0, 2], bonus=7, prefix_len=12, finished=False, finish_reason=None, verified=5,
                          logprobs=None)
    whole = ReplyFrame.decode(ReplyFrame.of_tree(res, 3, 8, tree_nodes=5).encode())
    cut = ReplyFrame.decode(ReplyFrame.of_tree(res, 3, 8, tree_nodes=9).encode())
    assert whole.verified is None and cut.verified == 5
    assert (whole.accepted, whole.bonus, whole.prefix_len, whole.depth_hint, whole.budget_hint) == ([0, 2], 7, 12, 3, 8)


def test_a_reply_outcome_read_from_the_header_is_the_decoded_replys():
    for frame in (ReplyFrame([0, 1], 5, 9, finished=True, finish_reason="stop"),
                  ReplyFrame([], 5, 9, ahead=[6, 7, 8]),
                  ReplyFrame([2], None, 9, rejected=True, reject_top_ids=[1, 2], reject_top_probs=[0.5, 0.2],
                             tail_mass=0.3, tail_ids=[4], tail_probs=[0.1]),
                  ReplyFrame([0], 3, 9, verified=4, ahead=[1])):
        data = frame.encode()
        out = ReplyFrame.outcome(data)
        assert (out.emitted, out.finished) == (ReplyFrame.decode(data).emitted, frame.finished)


def test_the_header_alone_refuses_what_decode_refuses_for_the_header():
    f = VerifyFrame(3, [1, 2], [-1, 0], early=True)
    assert VerifyFrame.header(f.encode()).early and VerifyFrame.header(f.encode()).nodes == 2
    with pytest.raises(PayloadTooLarge):
        VerifyFrame.header(f.encode(), max_nodes=1)
    with pytest.raises(InvalidRequest):
        VerifyFrame.header(f.encode()[:5])
    bad = bytearray(f.encode())
    bad[3] |= 0x80  # an unknown flag
    with pytest.raises(InvalidRequest):
        VerifyFrame.header(bytes(bad))
