"""Server-only decoding over the session protocol (deploy/router/server_decode.py), against a fake
session protocol: the rounds it yields, the frames it sends, and the close however it ends."""

from __future__ import annotations

import asyncio
import json

import pytest

from deploy.router.server_decode import ServerDecode
from deploy.router.server_draft import PromptLookupDrafter
from specdec.errors import Overloaded
from specdec.openai.request import parse_completion
from specdec.protocol import ReplyFrame, VerifyFrame

PROMPT = [5, 6, 7, 5, 6]


class FakeSessions:
    """The Router's session protocol: an open, then one bonus token per verify; finishes (closed by
    the server, ``close_on_finish``) after ``length`` generated tokens."""

    def __init__(self, length: int = 4, first_token: int = 100):
        self.length, self.first_token = length, first_token
        self.emitted, self.opened, self.frames, self.closed = 0, None, [], []

    async def open(self, tenant, body: dict, deadline_header=None, received_at=None) -> dict:
        self.opened, self.emitted, self.deadline_header, self.received_at = body, 1, deadline_header, received_at
        return {"session_id": "s.1", "prefix_len": len(body["prompt_ids"]), "first_token": self.first_token, "finished": False,
                "close_on_finish": True, "cached_tokens": 2}

    async def verify_frame(self, tenant, sid: str, f: VerifyFrame) -> ReplyFrame:
        self.frames.append(f)
        self.emitted += 1
        done = self.emitted >= self.length
        return ReplyFrame([], 100 + self.emitted, f.prefix_len + 1, finished=done,
                          finish_reason="length" if done else None)

    async def close(self, tenant, sid: str) -> dict:
        self.closed.append(sid)
        return {}


async def no_drafter():
    raise AssertionError("an AR request loads no drafter")


def collect(gen, limit: int | None = None) -> list:
    async def main():
        out = []
        async for r in gen:
            out.append(r)
            if limit is not None and len(out) == limit:
                await gen.aclose()
                break
        return out

    return asyncio.run(main())


def test_ar_rounds_open_then_verify_empty_trees_until_finished():
    sessions = FakeSessions(length=4)
    rounds = collect(ServerDecode(sessions, no_drafter).rounds("tenant", PROMPT, {"temperature": 0}, None))
    assert rounds[0].tokens == [] and rounds[0].finish is None  # the open, before any token
    assert [r.tokens for r in rounds[1:]] == [[100], [102], [103], [104]]
    assert rounds[-1].finish == "length" and rounds[-1].stats["rounds"] == 3 and rounds[-1].stats["cached_tokens"] == 2
    assert sessions.opened["close_on_finish"] and sessions.opened["client"] == {}
    assert all(f.tokens == [] for f in sessions.frames)  # AR: one target step a round
    assert [f.prefix_len for f in sessions.frames] == [5, 6, 7]
    assert sessions.closed == []  # the server closed it with its finishing reply


def test_an_abandoned_generation_closes_its_session():
    sessions = FakeSessions(length=100)
    collect(ServerDecode(sessions, no_drafter).rounds("tenant", PROMPT, {"temperature": 0}, None), limit=3)
    assert sessions.closed == ["s.1"]


@pytest.mark.parametrize("length", [2, 6])
def test_a_drafter_sends_its_trees_and_names_its_client_kind(length):
    sessions = FakeSessions(length=length, first_token=7)
    drafter = PromptLookupDrafter(depth=2)
    rounds = collect(ServerDecode(sessions, no_drafter).rounds("tenant", PROMPT, {"temperature": 0}, drafter))
    assert sessions.opened["client"] == {"draft": "server/PromptLookupDrafter"}
    assert sessions.frames[0].tokens == [5, 6] and sessions.frames[0].parents == [-1, 0]  # "5 6 7" came before
    assert rounds[-1].stats["draft_tokens"] == sum(len(f.tokens) for f in sessions.frames)


INFO = {"model": "served", "max_model_len": 64, "vocab_size": 512}


def test_a_whole_response_and_a_refused_open_keeping_its_status():
    req = parse_completion({"prompt": PROMPT, "temperature": 0, "unknown": 1}, None, False)
    resp = asyncio.run(ServerDecode(FakeSessions(length=3), no_drafter).respond("tenant", req, None, INFO, []))
    body = json.loads(resp.body)
    assert body["specedge"]["token_ids"] == [100, 102, 103] and body["choices"][0]["finish_reason"] == "length"
    assert body["model"] == "served" and resp.headers["x-ignored-fields"] == "unknown"

    class Refusing(FakeSessions):
        async def open(self, tenant, body, deadline_header=None, received_at=None):
            raise Overloaded("full", retry_after=2.0)

    with pytest.raises(Overloaded):  # before any response starts: the client gets its 429
        asyncio.run(ServerDecode(Refusing(), no_drafter).respond("tenant", req, None, INFO, []))


def test_the_open_deadline_header_and_arrival_reach_the_open():
    sessions = FakeSessions(length=2)
    req = parse_completion({"prompt": PROMPT, "temperature": 0}, None, False)
    asyncio.run(ServerDecode(sessions, no_drafter).respond("tenant", req, None, INFO, [], deadline_header="0.5",
                                                           received_at=12.5))
    assert (sessions.deadline_header, sessions.received_at) == ("0.5", 12.5)
