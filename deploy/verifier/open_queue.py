"""A verifier replica's opens from arrival to first token, against their deadlines (issue 67).

An admitted open waits here (``queued``, then ``prefilling``); one dropped unstarted at its deadline is answered 429."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from deploy.prefill_forecast import PrefillForecast, deadline_refusal
from deploy.verifier.queued_round import answer, error_reply
from specdec.engine import OpenRequest


@dataclass
class QueuedOpen:
    """An admitted open not yet handed to the engine."""

    req: OpenRequest
    tenant: str
    fut: asyncio.Future


class OpenQueue:
    """The replica's admitted opens, their deadlines and the forecast that admits them."""

    def __init__(self, forecast: PrefillForecast):
        self.forecast = forecast
        self.queued: list[QueuedOpen] = []  # not yet handed to the engine
        self.prefilling: dict[str, tuple[str, asyncio.Future]] = {}  # sid -> (tenant, future)
        self.deadlines: dict[str, float] = {}  # sid -> its deadline (s), while its request waits

    def __len__(self) -> int:
        return len(self.queued) + len(self.prefilling)

    async def wait(self, req: OpenRequest, tenant: str, fut: asyncio.Future,
                   deadline_s: float | None) -> tuple[int, dict]:
        """Queue an admitted open (``start_by`` set) and wait for its answer on ``fut``; its time feeds the forecast."""
        self.queued.append(QueuedOpen(req, tenant, fut))
        if deadline_s is not None:
            self.deadlines[req.sid] = deadline_s
        ticket, measured = self.forecast.started(len(req.prompt) + len(req.generated)), False
        try:
            out = await fut
            measured = out[0] == 200 or out[1].get("error", {}).get("reason") == "open_deadline_passed"
            return out
        finally:
            self.deadlines.pop(req.sid, None)
            self.forecast.finished(ticket, measured)

    def take(self) -> list[QueuedOpen]:
        """The queued opens, for the engine; the caller marks each :meth:`begun` (or answers it)."""
        opens, self.queued = self.queued, []
        return opens

    def begun(self, o: QueuedOpen) -> None:
        self.prefilling[o.req.sid] = (o.tenant, o.fut)

    def pop(self, sid: str) -> tuple[str, asyncio.Future] | None:
        """A prefilling open leaves (answered, failed or gone): its (tenant, future)."""
        return self.prefilling.pop(sid, None)

    def fail(self, sid: str, reply: tuple[int, dict]) -> None:
        """Answer a prefilling open with an error reply (if it is still here)."""
        waiting = self.pop(sid)
        if waiting is not None:
            answer(waiting[1], reply)

    def late(self, sids: list[str]) -> None:
        """Answer 429 the opens the engine dropped at their deadline, unstarted."""
        for sid in sids:
            self.fail(sid, error_reply(deadline_refusal(self.deadlines.get(sid, 0.0), self.forecast.retry_after_s)))
