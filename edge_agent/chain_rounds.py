"""The ``rejection`` rule's rounds (split rejection sampling over chains; Leviathan et al. 2023,
DSSD §3, PicoSpec §3.3).
Notes: docs/edge_agent.md, "edge_agent/chain_rounds.py"."""

from __future__ import annotations


from edge_agent.draft_session import ChainDraftSession
from edge_agent.errors import EdgeError
from edge_agent.link import LOST, SessionLink
from edge_agent.rounds import Edge, Generation, Rounds, edge_generator
from specdec import clock
from specdec.protocol import ReplyFrame, SessionOpened, VerifyFrame
from specdec.residual import Rejection, ResidualSampler


class ChainRounds(Rounds):
    """One generation's rounds under the ``rejection`` rule; a round that ends in a rejection
    leaves a residual sample owed to the server (or, candidates run out, a refill pending)."""

    def __init__(self, edge: Edge, link: SessionLink, gen: Generation, sess: SessionOpened):
        super().__init__(edge, link, gen, sess)
        params = gen.params
        self.stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(gen.info.eos_token_ids))
        self.cs: ChainDraftSession | None = None
        self.owed: int | None = None  # the residual sample the server has not seen yet (it is in ``generated``)
        self.pending: ResidualSampler | None = None  # a rejection whose residual sample is not drawn yet

    async def rounds(self) -> str | None:
        if self.finished:
            return self.finish_reason
        gen = self.gen
        self.cs = ChainDraftSession(self.edge.drafter, gen.info.vocab_size, gen.params, edge_generator(gen.params))
        self.cs.start(gen.history())
        while True:
            self.link.maybe_ping()
            self.link.ping_done()
            done = await (self._refill() if self.pending is not None else self._round())
            if done:
                return self.finish_reason

    async def _refill(self) -> bool:
        """The residual's tail candidates ran out: ask for more (no draft). Whether the generation ended."""
        t, prefix_len = self.telemetry, self.gen.prefix_len + 1
        frame = VerifyFrame(prefix_len=prefix_len, tokens=[], parents=[], q=[], more=True,
                            draft_ms=t.draft_ms.get(0.0), rtt_ms=t.rtt_ms.get(0.0))
        try:
            reply = await self.link.verify(frame)
        except LOST:
            self.stalled += 1
            if self.stalled > self.config.max_reopens:
                raise
            await self.link.reopen(self.stalled)  # the new session answers with a whole new rejection
            return False
        self.stats.refills += 1
        if not reply.rejected:
            raise EdgeError("the server answered a request for residual candidates without them")
        if reply.reject_top_ids:  # a re-opened session sent a whole new rejection
            self.pending.reset(_rejection(reply))
        else:
            self.pending.extend(_rejection(reply))
        tok = self.pending.sample()
        if tok is None:
            return False
        self.pending = None
        return await self._resampled(tok, prefix_len)

    async def _round(self) -> bool:
        """Draft and send a chain, apply the reply. Whether the generation ended."""
        cfg, cs, gen = self.config, self.cs, self.gen
        remaining = gen.params.max_tokens - len(gen.generated)
        npl = 1.0  # a chain: one node per level
        depth = self.edge.policy.choose(self.telemetry, self.depth_hint, npl, self.stats.rounds)
        cap = min(cfg.max_depth, gen.info.max_tree_depth, gen.info.max_tree_nodes, cfg.budget,
                  self.budget_hint or cfg.budget)
        depth = max(0, min(depth, remaining - 1, cap))
        if self.budget_hint == 0:  # the server says drafts do not pay now: plain decoding
            depth = 0
        n_fwd0 = len(cs.forward_times)
        await self.draft(cs.draft, depth)
        send = 0 if depth == 0 else min(max(depth, len(cs.chain)), remaining - 1, cap)
        tokens, qs = cs.freeze(send)
        self.observe_drafts(cs, n_fwd0)
        self.stats.draft_forwards += len(cs.forward_times) - n_fwd0
        t = self.telemetry
        frame = VerifyFrame(prefix_len=gen.prefix_len, tokens=tokens, parents=list(range(-1, len(tokens) - 1)),
                            q=qs, resampled=self.owed, draft_ms=t.draft_ms.get(0.0), rtt_ms=t.rtt_ms.get(0.0),
                            depth=cs.forwards)
        t0 = clock.perf_counter()
        proactive = cfg.mode == "proactive" and self.budget_hint != 0
        task = await self.send_and_draft(frame, cs, cs.proactive_step if proactive else None,
                                         self.proactive_cap(depth))
        reply, sess = await self.link.reply_or_reopen(task, self.stalled)
        if sess is not None:
            self.stalled += 1
            self.owed = None  # the owed token is in the history now
            if sess.finished:
                self.finish_reason = sess.finish_reason
                return True
            self.take_hints(sess)
            cs.start(gen.history())
            return False
        return await self._apply(reply, frame, tokens, (clock.perf_counter() - t0) * 1e3)

    async def _apply(self, reply: ReplyFrame, frame: VerifyFrame, tokens: list[int], round_ms: float) -> bool:
        """Emit the accepted tokens, then the bonus or a residual sample. Whether the generation ended."""
        cs, stats = self.cs, self.stats
        self.stalled = 0
        n_acc = len(reply.accepted)
        if reply.ahead or reply.accepted != list(range(n_acc)) or n_acc > len(tokens) or (
                reply.prefix_len != frame.prefix_len + n_acc + (not reply.finished or reply.bonus is not None)):
            raise EdgeError(f"reply (prefix length {reply.prefix_len}, {n_acc} accepted) does not match "
                            "the chain sent")
        self.owed = None
        stats.rounds += 1
        stats.draft_tokens += len(tokens)
        stats.verified_nodes += len(tokens)
        stats.accepted_tokens += n_acc
        stats.depth_sum += len(tokens)
        stats.round_ms.append(round_ms)
        self.telemetry.observe_round(len(tokens), n_acc, len(tokens), round_ms)
        self.take_hints(reply)
        if reply.rejected:
            stats.rejections += 1
            sampler = ResidualSampler(_rejection(reply), cs.q_at(n_acc), cs.generator)
            self.gen.emit(tokens[:n_acc])
            stats.round_tokens += n_acc
            cs.on_reply(n_acc, None)
            tok = sampler.sample()
            if tok is None:
                self.pending = sampler
                return False
            return await self._resampled(tok, reply.prefix_len)
        al = cs.on_reply(n_acc, reply.bonus)
        self.gen.emit(tokens[:n_acc] + ([reply.bonus] if reply.bonus is not None else []))
        stats.round_tokens += n_acc + (reply.bonus is not None)
        stats.align_attempts += al.attempted
        stats.aligned += al.aligned
        stats.reused_tokens += al.reused
        self.finish_reason = reply.finish_reason
        return reply.finished

    async def _resampled(self, tok: int, prefix_len: int) -> bool:
        """Emit the residual sample (owed to the server); a stop or the length limit ends the
        generation here, and the server hears of it for its finish reason."""
        self.owed = tok
        self.gen.emit([tok])
        self.stats.round_tokens += 1  # the rejected round's residual sample
        self.cs.start(self.gen.history())
        if tok in self.stops or len(self.gen.generated) >= self.gen.params.max_tokens:
            self.finish_reason = await self._send_owed(prefix_len, tok)
            return True
        return False

    async def _send_owed(self, prefix_len: int, owed: int) -> str | None:
        """The owed token ends the generation: tell the server (an empty chain), for its finish reason."""
        try:
            reply = await self.link.verify(VerifyFrame(prefix_len=prefix_len, tokens=[], parents=[], q=[],
                                                       resampled=owed))
        except LOST:
            return None  # the output is complete either way
        return reply.finish_reason


def _rejection(reply: ReplyFrame) -> Rejection:
    """The edge's half of a rejection reply (:mod:`specdec.residual`)."""
    return Rejection(tuple(reply.reject_top_ids), tuple(reply.reject_top_probs), reply.tail_mass,
                     tuple(reply.tail_ids), tuple(reply.tail_probs))
