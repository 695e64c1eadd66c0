"""A verify round queued for the engine, and how the replica answers its requests.

An answer is ``(status, payload)``, never an exception (errors cross the Ray boundary as data). Pure module."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from deploy.verifier.rules import RULES, VerifierRule
from specdec.engine import ChainVerifyRequest, VerifyRequest
from specdec.errors import SpecError

log = logging.getLogger("ray.serve")


@dataclass
class QueuedRound:
    """A verify round waiting for the engine (a scheduler :class:`~deploy.verifier.scheduler.Pending`'s payload)."""

    req: VerifyRequest | ChainVerifyRequest
    fut: asyncio.Future | None  # the request it answers; None for a run-ahead step (its run's)
    gains: list[float]  # per-node draft gains, for batch-time truncation ([] when off)
    run: Any = None  # the deploy.verifier.run_ahead.RunAhead this round belongs to, if any
    rule: VerifierRule = field(default_factory=lambda: RULES.get("match"))  # a run-ahead step's: match

    @property
    def answers(self) -> asyncio.Future | None:
        """The request this round answers: a run-ahead step's is its run's (None while detached)."""
        return self.run.fut if self.run is not None else self.fut


def error_reply(e: SpecError) -> tuple[int, dict]:
    return e.status, e.to_dict()


def internal_reply(e: Exception) -> tuple[int, dict]:
    return 500, {"error": {"code": "internal", "message": str(e)}}


def answer(fut: asyncio.Future | None, result) -> None:
    """Answer a request unless its client has gone (a cancelled future) or there is none (detached run-ahead)."""
    if fut is not None and not fut.done():
        fut.set_result(result)


def answer_each(items, reply) -> None:
    """Answer each ``(future, item)`` with ``reply(item)``, independently: one that raises answers its own
    request 500 (issue 14); ``None`` from ``reply``: not answered yet (a run-ahead request requeued)."""
    for fut, item in items:
        try:
            result = reply(item)
        except Exception as e:
            log.exception("answering a request failed")
            result = internal_reply(e)
        if result is not None:
            answer(fut, result)
