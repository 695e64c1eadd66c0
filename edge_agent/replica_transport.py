"""The edge protocol against a verifier replica in this process (no Serve, no HTTP).
Notes: docs/edge_agent.md, "edge_agent/replica_transport.py"."""

from __future__ import annotations


from edge_agent.errors import error_from_json
from edge_agent.transport.base import ModelInfo, Transport
from specdec import clock
from specdec.protocol import OpenSession, ReplyFrame, SessionOpened, VerifyFrame


class ReplicaTransport(Transport):
    def __init__(self, core, tenant: str = "dev", rtt_ms: float = 0.0):
        self.core, self.tenant, self.rtt_ms = core, tenant, rtt_ms

    async def _net(self) -> None:
        if self.rtt_ms > 0:
            await clock.sleep(self.rtt_ms / 2e3)

    async def _answer(self, call):
        await self._net()  # uplink
        status, payload = await call
        await self._net()  # downlink
        if status >= 400:
            raise error_from_json(status, payload)
        return payload

    async def model_info(self) -> ModelInfo:
        return ModelInfo.from_dict(self.core.model_info())

    async def open(self, req: OpenSession) -> SessionOpened:
        body = OpenSession.model_validate_json(req.model_dump_json()).model_dump()  # as it would arrive
        return SessionOpened(**await self._answer(self.core.open_session(self.tenant, body)))

    async def verify(self, sid: str, frame: VerifyFrame) -> ReplyFrame:
        return ReplyFrame.decode(await self._answer(self.core.verify(sid, self.tenant, frame.encode())))

    async def close(self, sid: str) -> None:
        await self._answer(self.core.close_session(sid, self.tenant))

    async def ping(self) -> float:
        t0 = clock.perf_counter()
        await self._net()
        await self._net()
        return clock.perf_counter() - t0
