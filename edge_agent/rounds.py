"""What the agent's round loops share (:mod:`edge_agent.tree_rounds`, :mod:`edge_agent.chain_rounds`):
the generation being decoded, the agent's parts they use, and sending a frame while drafting
proactively (SpecEdge §4.2).
Notes: docs/edge_agent.md, "edge_agent/rounds.py"."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

import torch

from edge_agent.config import AgentConfig
from edge_agent.depth import DepthPolicy, Telemetry
from edge_agent.draft_executor import CRITICAL, DraftExecutor
from edge_agent.draft_backends import Drafter
from edge_agent.link import SessionLink
from edge_agent.stats import GenerationStats
from edge_agent.transport.base import ModelInfo
from specdec.protocol import SessionOpened, VerifyFrame
from specdec.sampling import SamplingParams


@dataclass
class Generation:
    """The generation being decoded: ``emit`` appends verified tokens to ``generated`` (and
    streams them)."""

    info: ModelInfo
    params: SamplingParams
    prompt_ids: list[int]
    generated: list[int]
    stats: GenerationStats
    emit: Callable[..., None]  # (tokens, target log-probs or None)

    @property
    def prefix_len(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    def history(self) -> list[int]:
        return self.prompt_ids + self.generated


@dataclass
class Edge:
    """The agent's parts a round loop uses (they outlive the generation)."""

    config: AgentConfig
    drafter: Drafter
    policy: DepthPolicy
    telemetry: Telemetry
    drafts: DraftExecutor  # draft forwards: one worker thread, maybe shared by agents on one device


def edge_generator(params: SamplingParams) -> torch.Generator | None:
    """The edge's own randomness (draft samples, residual samples), independent of the server's.
    With a seed, a run repeats exactly when its rounds do not depend on timing (stop-and-wait,
    fixed depth); the output distribution is the target's in every case."""
    if params.greedy:
        return None
    g = torch.Generator()
    g.manual_seed((params.seed ^ 0x5EED_ED6E) if params.seed is not None else int(torch.randint(0, 2**62, ())))
    return g


class Rounds:
    """A verify rule's rounds over one session until it finishes: :meth:`run` returns the
    finish reason and closes the session whatever happens."""

    def __init__(self, edge: Edge, link: SessionLink, gen: Generation, sess: SessionOpened):
        self.edge, self.link, self.gen = edge, link, gen
        self.config, self.telemetry, self.stats = edge.config, edge.telemetry, gen.stats
        self.depth_hint, self.budget_hint = sess.depth_hint, sess.budget_hint  # the server's pacing
        self.finished, self.finish_reason = sess.finished, sess.finish_reason
        self.stalled = 0  # re-opens since the last verified round

    async def run(self) -> str | None:
        try:
            return await self.rounds()
        finally:
            self.link.stop_pings()
            await self.link.close()

    async def rounds(self) -> str | None:
        raise NotImplementedError

    def take_hints(self, reply) -> None:
        """The pacing hints of a reply or a re-opened session."""
        self.depth_hint = reply.depth_hint or self.depth_hint
        self.budget_hint = reply.budget_hint

    def proactive_cap(self, depth: int) -> int:
        """Proactive tokens worth drafting while a round of ``depth`` levels is away (SpecEdge
        §4.2): the bonus guess plus the next tree's levels. Deeper chains are only kept when
        every level aligns, and they cost the edge's power (and, sharing a host, its neighbour's
        memory bandwidth)."""
        return self.config.proactive_max or min(depth + 1, self.config.max_depth)

    async def draft(self, fn, *args):
        """A draft forward the session's next request waits for."""
        return await self.edge.drafts.run(CRITICAL, fn, *args)

    async def send_and_draft(self, frame: VerifyFrame, session, step=None, *args) -> asyncio.Task:
        """Send ``frame``; while its reply is on the way, run ``step(*args)`` (proactive
        drafting, SpecEdge §4.2) until it has nothing more to do. Returns the verify task."""
        task = asyncio.create_task(self.link.verify(frame))
        if step is not None:
            n0 = len(session.forward_times)
            while not task.done():
                ran, more = await self.edge.drafts.run_until(task, step, *args)
                if not (ran and more):
                    break
            self.stats.proactive_forwards += len(session.forward_times) - n0
            self.observe_drafts(session, n0)
        return task

    def observe_drafts(self, session, start: int) -> None:
        """The draft forwards ``session`` ran since ``start``, into the telemetry and the stats."""
        for s in session.forward_times[start:]:
            self.telemetry.observe_draft(s)
            self.stats.draft_ms.append(s * 1e3)
