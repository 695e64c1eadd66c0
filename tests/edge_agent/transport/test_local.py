"""LocalTransport: the protocol against an engine in this process, lost sessions reported."""

from __future__ import annotations

import asyncio

import pytest

from specdec import errors as E
from specdec.protocol import OpenSession, VerifyFrame
from specdec.engine import VerifierEngine
from specdec.model.loading import tiny_random_model
from edge_agent.transport import LocalTransport


def test_local_transport_speaks_the_protocol_and_reports_lost_sessions():
    eng = VerifierEngine(tiny_random_model(seed=0), eos_token_ids=[2])
    tr = LocalTransport(eng, rtt_ms=2.0)

    async def main():
        info = await tr.model_info()
        assert info.vocab_size == 512 and info.eos_token_ids == (2,)
        s = await tr.open(OpenSession(prompt_ids=[1, 2, 3], sampling={"max_tokens": 8}))
        assert s.prefix_len == 4 and s.first_token is not None and s.depth_hint >= 1
        r = await tr.verify(s.session_id, VerifyFrame(prefix_len=4, tokens=[7, 8], parents=[-1, 0]))
        assert r.prefix_len == 5 + len(r.accepted) and r.bonus is not None
        with pytest.raises(E.PrefixMismatch):
            await tr.verify(s.session_id, VerifyFrame(prefix_len=4, tokens=[], parents=[]))
        tr.drop_session(s.session_id)
        with pytest.raises(E.SessionEvicted):
            await tr.verify(s.session_id, VerifyFrame(prefix_len=r.prefix_len, tokens=[], parents=[]))
        with pytest.raises(E.SessionNotFound):
            await tr.verify("nope", VerifyFrame(prefix_len=4, tokens=[], parents=[]))
        assert await tr.ping() >= 0.002

    asyncio.run(main())
