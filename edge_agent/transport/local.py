"""A :class:`specdec.engine.VerifierEngine` in this process behind the protocol
(``edge-agent --local``, fast tests).
Notes: docs/edge_agent.md, "edge_agent/transport/local.py"."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Callable

from edge_agent.transport.base import ModelInfo, Transport
from specdec import clock
from specdec.errors import SessionEvicted, SpecError
from specdec.protocol import EarlyFrame, OpenSession, ReplyFrame, SessionOpened, VerifyFrame


class LocalTransport(Transport):
    """A verifier engine in this process, behind the same interface as the server."""

    def __init__(self, engine, *, model_name: str = "local", tokenizer_fingerprint: str = "none",
                 rtt_ms: float = 0.0, default_depth: int = 4, max_depth: int = 12, budget_hint: int = 32,
                 before_verify: Callable[["LocalTransport", str, int], None] | None = None, tokenizer=None):
        from specdec.grammar import GrammarCompiler

        self.engine = engine
        self.grammars = GrammarCompiler(tokenizer, engine.vocab_size, engine.eos_token_ids)  # structured output
        self.model_name = model_name
        self.fingerprint = tokenizer_fingerprint
        self.rtt_ms = rtt_ms
        self.default_depth, self.max_depth, self.budget_hint = default_depth, max_depth, budget_hint
        self.before_verify = before_verify  # test hook: (transport, sid, round) before each verify
        self.rounds = 0
        self.evicted: set[str] = set()
        self.closes_on_finish: set[str] = set()  # sessions closed with their finishing reply, as the server does
        self.verify_ms: float | None = None  # EMA of engine verify time (pacing)
        self._lock = threading.Lock()  # one engine call at a time (agents may share a transport)

    async def _net(self) -> None:
        if self.rtt_ms > 0:
            await clock.sleep(self.rtt_ms / 2e3)

    async def _call(self, fn, *args):
        await self._net()  # uplink
        def run():
            with self._lock:
                return fn(*args)
        out = await asyncio.to_thread(run)
        await self._net()  # downlink
        return out

    def _depth_hint(self, draft_ms: float, rtt_ms: float) -> int:
        """SpecEdge §4.3: depth such that edge draft time + RTT ≈ server verify time."""
        if self.verify_ms is None or draft_ms <= 0:
            return self.default_depth
        d = round((self.verify_ms - rtt_ms) / draft_ms)
        return max(1, min(self.max_depth, d))

    async def model_info(self) -> ModelInfo:
        e = self.engine
        return ModelInfo(self.model_name, e.vocab_size, tuple(sorted(e.eos_token_ids)), self.fingerprint,
                         e.limits.max_nodes, e.limits.max_depth,
                         tuple(e.exit_heads.layers) if getattr(e, "exit_heads", None) is not None else ())

    async def open(self, req: OpenSession) -> SessionOpened:
        from specdec.engine import OpenRequest
        from specdec.sampling import SamplingParams

        req = OpenSession.model_validate_json(req.model_dump_json())  # as it would arrive
        sid = uuid.uuid4().hex
        params = SamplingParams.from_dict(req.sampling)
        version = None if req.model in (None, "base", self.model_name) else req.model  # a LoRA target version
        grammar = self.grammars.state_of(req.grammar)
        (res,) = await self._call(self.engine.open, [OpenRequest(sid, list(req.prompt_ids), params,
                                                                 tuple(req.generated_ids), adapter=version,
                                                                 grammar=grammar)])
        if isinstance(res, SpecError):
            raise res
        if req.close_on_finish:
            self.closes_on_finish.add(sid)
            self._close_if_finished(sid, res.finished)
        return SessionOpened(session_id=sid, first_token=res.first_token, prefix_len=res.prefix_len,
                             first_logprob=res.first_logprob.to_dict() if res.first_logprob is not None else None,
                             finished=res.finished, finish_reason=res.finish_reason,
                             depth_hint=self._depth_hint(req.client.draft_ms, req.client.rtt_ms),
                             budget_hint=self.budget_hint, tokenizer_fingerprint=self.fingerprint,
                             model=self.model_name, close_on_finish=req.close_on_finish)

    def _close_if_finished(self, sid: str, finished: bool) -> None:
        """``close_on_finish``: the session goes with its finishing reply (in the engine's thread)."""
        if finished and sid in self.closes_on_finish:
            self.closes_on_finish.discard(sid)
            self.engine.close(sid)

    def drop_session(self, sid: str, evicted: bool = True) -> None:
        """Test hook: the server loses the session (evicted -> 410, else -> 404)."""
        self.engine.close(sid)
        if evicted:
            self.evicted.add(sid)

    def _verify(self, sid: str, body: bytes, on_early=None) -> bytes:
        from specdec.engine import ChainVerifyRequest, VerifyRequest
        from specdec.errors import InvalidRequest
        from specdec.tree import DraftTree

        if sid in self.evicted:
            raise SessionEvicted(f"session {sid!r} was evicted")
        frame = VerifyFrame.decode(body)
        t0 = clock.perf_counter()
        if frame.q is None:  # a tree: sample, then match (with proposals: tree rejection sampling)
            (res,) = self.engine.verify([VerifyRequest(sid, DraftTree(tuple(frame.tokens), tuple(frame.parents)),
                                                       frame.prefix_len, proposals=frame.proposals,
                                                       early=frame.early)], on_early=on_early if frame.early else None)
        else:  # a chain with q(x): rejection sampling (the server's checks, as the replica makes them)
            if any(p != i - 1 for i, p in enumerate(frame.parents)):
                raise InvalidRequest("chain mode: parents must form a chain")
            (res,) = self.engine.verify_chain([ChainVerifyRequest(sid, tuple(frame.tokens), tuple(frame.q),
                                                                  frame.prefix_len, frame.resampled, frame.more)])
        ms = (clock.perf_counter() - t0) * 1e3
        if not frame.more:  # a refill of residual candidates runs no forward
            self.verify_ms = ms if self.verify_ms is None else 0.8 * self.verify_ms + 0.2 * ms
        if isinstance(res, SpecError):
            raise res
        self._close_if_finished(sid, res.finished)
        depth = self._depth_hint(frame.draft_ms, frame.rtt_ms)
        if frame.q is not None:
            return ReplyFrame.of_chain(res, depth, self.budget_hint).encode()
        return ReplyFrame.of_tree(res, depth, self.budget_hint, len(frame.tokens)).encode()

    async def verify(self, sid: str, frame: VerifyFrame, on_early=None) -> ReplyFrame:
        if self.before_verify is not None:
            self.before_verify(self, sid, self.rounds)
        self.rounds += 1
        sink = _early_sink(asyncio.get_running_loop(), on_early, self.rtt_ms / 2e3) if on_early else None
        return ReplyFrame.decode(await self._call(self._verify, sid, frame.encode(), sink))

    async def close(self, sid: str) -> None:
        self.closes_on_finish.discard(sid)
        await self._call(self.engine.close, sid)

    async def ping(self) -> float:
        t0 = clock.perf_counter()
        await self._net()
        await self._net()
        return clock.perf_counter() - t0


def _early_sink(loop: asyncio.AbstractEventLoop, on_early, delay_s: float):
    """The engine's ``on_early`` (worker thread, mid-forward) -> ``on_early(EarlyFrame)`` on the
    event loop after the simulated downlink delay, through the wire codec."""
    def sink(results) -> None:
        for r in results:
            f = EarlyFrame.decode(EarlyFrame(r.prefix_len, r.layer, list(r.accepted), r.token, r.confidence).encode())
            loop.call_soon_threadsafe(loop.call_later, delay_s, on_early, f)
    return sink
