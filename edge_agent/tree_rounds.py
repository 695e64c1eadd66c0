"""The tree rules' rounds (``match``, ``tree-rejection``): draft a tree -> send it -> (proactively
draft, or pre-draft) -> apply the reply, until the server says the session finished.
Notes: docs/edge_agent.md, "edge_agent/tree_rounds.py"."""

from __future__ import annotations

import asyncio

from edge_agent.draft_session import DraftSession
from edge_agent.errors import EdgeError
from edge_agent.link import SessionLink
from edge_agent.predraft import PreDraftCache
from edge_agent.rounds import Edge, Generation, Rounds, edge_generator
from edge_agent.sampled_tree import SampledTreeSession
from edge_agent.tree_builder import TreeConfig
from edge_agent.tree_session import TreeSession
from specdec import clock
from specdec.protocol import ReplyFrame, SessionOpened, VerifyFrame
from specdec.tree import DraftTree


class TreeRounds(Rounds):
    """One generation's rounds under ``rule`` (``match`` or ``tree-rejection``), drafting through
    a :class:`~edge_agent.tree_session.TreeSession`."""

    def __init__(self, edge: Edge, link: SessionLink, gen: Generation, sess: SessionOpened, rule: str):
        super().__init__(edge, link, gen, sess)
        cfg, info, params = edge.config, gen.info, gen.params
        self.rule = rule
        self.ds: TreeSession
        if rule == "tree-rejection":
            self.ds = SampledTreeSession(edge.drafter, info.vocab_size, params, edge_generator(params),
                                         self.tree_config())
        else:
            self.ds = DraftSession(edge.drafter, self.tree_config())
        self.ds.start(gen.history())
        self.early = cfg.predraft and bool(info.early_exit_layers) and rule == "match"
        self.guessing = cfg.guesses > 0 and cfg.mode == "proactive" and rule == "match" and not self.early
        # pre-drafted next trees (match rule only: self.ds is a DraftSession)
        self.pc = (PreDraftCache(self.ds, max_entries=cfg.guesses) if self.guessing
                   else PreDraftCache(self.ds) if self.early else None)
        self.last_verified: int | None = None  # nodes the server verified of the last tree (it truncates by prefix)
        self.predrafted = 0  # forwards the next tree already has (a pre-draft cache hit)

    def tree_config(self) -> TreeConfig:
        cfg, info = self.config, self.gen.info
        budget = min(cfg.budget, info.max_tree_nodes, self.budget_hint)
        return TreeConfig(budget=max(1, budget), topk=cfg.topk, max_expand=cfg.max_expand,
                          max_depth=min(cfg.max_depth, info.max_tree_depth))

    async def run(self) -> str | None:
        try:
            return await super().run()
        finally:
            self._count_predrafts()

    async def rounds(self) -> str | None:
        while not self.finished:
            self.link.maybe_ping()
            proactive = self.config.mode == "proactive" and self.budget_hint != 0 and self.rule == "match"
            tree, frame = await self._draft_tree(proactive)
            t0 = clock.perf_counter()
            task = await self._send(frame, len(tree), proactive)
            self.predrafted = 0
            reply, sess = await self.link.reply_or_reopen(task, self.stalled)
            if sess is not None:
                self.stalled += 1
                self.finished, self.finish_reason = sess.finished, sess.finish_reason
                self.take_hints(sess)
                self.ds.start(self.gen.history())
                continue
            self._apply(reply, tree, frame, (clock.perf_counter() - t0) * 1e3)
            self.link.ping_done()
        return self.finish_reason

    async def _draft_tree(self, proactive: bool) -> tuple[DraftTree, VerifyFrame]:
        """Grow the round's tree to the policy's depth; the frame that sends it."""
        cfg, ds, stats = self.config, self.ds, self.stats
        tree_cfg = self.tree_config()
        ds.set_config(tree_cfg)
        policy = self.edge.policy
        npl = max(1.0, min(tree_cfg.budget / max(policy.depth, 1), tree_cfg.max_expand * tree_cfg.topk))
        depth = policy.choose(self.telemetry, self.depth_hint, npl, stats.rounds)
        remaining = self.gen.params.max_tokens - len(self.gen.generated)
        depth = max(0, min(depth, remaining - 1, tree_cfg.max_depth))
        if self.budget_hint == 0:  # the server says trees do not pay now: plain decoding
            depth = 0
        n_fwd0 = len(ds.forward_times)
        await self.draft(ds.draft, depth - self.predrafted)
        tree, order = ds.freeze(max_chain=self.proactive_cap(depth) if proactive else 0)
        self.observe_drafts(ds, n_fwd0)
        stats.draft_forwards += len(ds.forward_times) - n_fwd0
        t = self.telemetry
        frame = VerifyFrame(prefix_len=self.gen.prefix_len, tokens=list(tree.tokens), parents=list(tree.parents),
                            draft_ms=t.draft_ms.get(0.0), rtt_ms=t.rtt_ms.get(0.0), depth=ds.forwards,
                            conf=ds.confidences(order) if cfg.send_confidence and len(tree) else None,
                            proposals=ds.proposals(), early=self.early and len(tree) > 0)
        frame.ahead = cfg.run_ahead and self.rule == "match" and not frame.early
        stats.early_asks += frame.early
        return tree, frame

    async def _send(self, frame: VerifyFrame, nodes: int, proactive: bool) -> asyncio.Task:
        """Send the round's frame; pre-drafts first, proactive drafting in between, while it is away."""
        guess_nodes = None  # the edge's own guesses: how many nodes of this tree it expects verified
        if self.guessing and proactive and nodes:
            guess_nodes = nodes if self.last_verified is None else min(self.last_verified, nodes)
        if frame.early or guess_nodes is not None:
            self.pc.begin_round(frame.prefix_len, self.ds.forwards, guess_nodes)
            return await self._send_and_predraft(frame, proactive)
        return await self.send_and_draft(frame, self.ds, self.ds.proactive_step if proactive else None)

    async def _send_and_predraft(self, frame: VerifyFrame, proactive: bool) -> asyncio.Task:
        """Send ``frame`` (asking for early results when ``frame.early``); while its reply is on the
        way, pre-draft from the round's guesses and each early result as it arrives (most
        confident first), and extend the proactive chain when there is none to work on (the
        early-exit paper's Algorithm 1 over SpecEdge §4.2)."""
        ds, pc, drafts = self.ds, self.pc, self.edge.drafts
        wake = asyncio.Event()

        def on_early(f) -> None:
            if pc.offer(f):
                wake.set()

        task = asyncio.create_task(self.link.verify(frame, on_early if frame.early else None))
        n0, p0 = len(ds.forward_times), pc.stats.forwards
        chain = proactive
        while not task.done():
            wake.clear()  # before the checks: an early result from now on wakes the wait below
            if pc.pending():
                await drafts.run_until(task, pc.step)
                continue
            if chain and pc.room() > 1:  # the chain and the pre-drafts share the draft's tree bits
                ran, more = await drafts.run_until(task, ds.proactive_step)
                chain = more if ran else chain  # withdrawn: the reply is in, the loop ends
                continue
            waiter = asyncio.ensure_future(wake.wait())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        self.stats.proactive_forwards += len(ds.forward_times) - n0 - (pc.stats.forwards - p0)
        self.observe_drafts(ds, n0)
        return task

    def _apply(self, reply: ReplyFrame, tree: DraftTree, frame: VerifyFrame, round_ms: float) -> None:
        """Emit what the reply verified, prepare the next tree, learn from the round."""
        stats, pc = self.stats, self.pc
        self.stalled = 0
        if reply.prefix_len != self.gen.prefix_len + reply.emitted or (reply.ahead and not frame.ahead):
            raise EdgeError(f"reply prefix length {reply.prefix_len} does not match the history")
        emitted = reply.tokens(list(tree.tokens))
        # a run-ahead reply's prefix goes past every outcome the cache drafted for: never a hit
        hit = pc.take(list(reply.accepted), None if reply.ahead else reply.bonus) if pc is not None else None
        if hit is not None:  # the pre-draft cache holds this outcome's next tree, drafted already
            al = pc.install(hit)
            self.predrafted = hit.builder.forwards
        else:  # a miss: proactive alignment or a fresh tree, as without early results
            al = self.ds.on_reply(list(reply.accepted), reply.bonus, emitted)
        self.gen.emit(emitted, reply.token_logprobs(list(tree.tokens)))
        stats.rounds += 1
        verified = len(tree) if reply.verified is None else reply.verified  # the server may cut a prefix
        if len(tree):
            self.last_verified = verified
        stats.draft_tokens += len(tree)
        stats.verified_nodes += verified
        stats.accepted_tokens += len(reply.accepted)
        stats.ahead_tokens += len(reply.ahead)
        stats.round_tokens += len(emitted)
        stats.depth_sum += tree.depth
        stats.round_ms.append(round_ms)
        stats.align_attempts += al.attempted
        stats.aligned += al.aligned
        stats.reused_tokens += al.reused
        if not reply.ahead:  # a run-ahead round's time is several forwards: not a round's server time
            self.telemetry.observe_round(tree.depth, len(reply.accepted), verified, round_ms)
        self.take_hints(reply)
        self.finished, self.finish_reason = reply.finished, reply.finish_reason

    def _count_predrafts(self) -> None:
        if self.pc is not None:
            s, stats = self.pc.stats, self.stats
            stats.early_frames, stats.predraft_hits, stats.predraft_misses = s.early_frames, s.hits, s.misses
            stats.predraft_forwards, stats.predraft_layer_sum = s.forwards, s.layer_sum
            stats.predraft_early_hits, stats.predraft_guessed = s.early_hits, s.guessed
