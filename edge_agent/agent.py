"""The edge agent: draft locally, verify remotely, stream what the target accepts.

:class:`EdgeAgent.generate` runs one generation (docs/protocol.md, "One generation, end to
end", steps 1-6): open a session,
then rounds of *draft a tree -> send it -> (proactively draft) -> apply the reply*
until the server says the session finished. Modes (benchmarks compare them):

- ``stop-and-wait``: draft, send, wait idle for the reply.
- ``proactive`` (SpecEdge §4.2): while the reply is in flight, keep drafting from the
  best leaf; on complete draft alignment the next tree starts from that work. With
  ``guesses``, before that chain the edge drafts the next tree for each of the round's
  likeliest outcomes by its own draft's estimate (:mod:`edge_agent.predraft`), and sends the
  one the reply confirms at once.

Verification rules (``AgentConfig.verify``):

- ``match`` (default): draft trees, the server samples the target and follows matching
  children ("sample, then match"); no draft probabilities on the wire.
- ``rejection`` (DSSD / PicoSpec split rejection sampling): draft *chains* sampled from the
  draft's q with q(x) per token; the server accepts x w.p. min(1, p/q), and on a rejection
  the edge samples the replacement from the residual norm(max(0, p - q)) with its own q and
  the reply's part of p (:class:`specdec.acceptance.ResidualSampler`; when those
  candidates run out it asks for more, a round trip without a forward), then carries the
  token in its next frame. Accepts far more than sample-then-match at temperature > 0;
  greedy output is the same. Proactive drafting extends the chain while a reply is in
  flight (:class:`edge_agent.drafting.ChainDraftSession`).
- ``tree-rejection`` (multi-draft rejection sampling over trees): trees whose siblings are
  drawn without replacement from a sparse proposal of q, sent with the tree; the server holds
  p and q and samples every residual itself (:class:`edge_agent.sampled_tree.SampledTreeSession`;
  stop-and-wait rounds). Greedy requests use ``match``.
- ``auto``: per request, greedy -> ``match``; temperature > 0 -> the rule with the highest
  acceptance (tokens per verify round trip) at that temperature: a prior from the measured
  benchmark, then this agent's own measurements, optionally kept in a JSON state file across
  processes (``verify_state``; :mod:`edge_agent.verify_policy`).

Concurrency mechanism: the verify call is an ``asyncio`` task on the event loop (network
I/O for :class:`HttpTransport`; a worker thread for :class:`LocalTransport`'s engine).
Every draft forward runs on one worker thread (:class:`edge_agent.draft_executor.DraftExecutor`:
the agent's own, or one shared by the agents on one device); torch releases the GIL inside
its kernels, so the network wait (or the in-process verifier) and the draft model truly
overlap. Proactive drafting is a loop of one-forward steps that checks ``task.done()``
between steps and withdraws a step that has not started when the reply lands, so a reply
is picked up at most one draft forward after it lands, and on a shared device the trees
that sessions wait for run before any session's proactive work.

Robustness: the agent keeps the whole token history. A lost or evicted session (410
``session_evicted``, 404 ``session_not_found``, a verify whose reply was lost, a 409
prefix mismatch) is re-opened with ``generated_ids`` = everything emitted so far, so no
token is lost or duplicated; 429 waits ``Retry-After`` and resends the same frame.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from specdec.errors import Overloaded, PrefixMismatch, SessionEvicted, SessionNotFound
from specdec.protocol import ClientInfo, OpenSession, ReplyFrame, SessionOpened, TokenLogprob, VerifyFrame
from specdec.residual import Rejection, ResidualSampler
from specdec.sampling import SamplingParams
from edge_agent.depth import DepthPolicy, Telemetry
from edge_agent.draft_executor import CRITICAL, DraftExecutor
from edge_agent.drafter import Drafter
from edge_agent.drafting import Alignment, ChainDraftSession, DraftSession
from edge_agent.predraft import PreDraftCache
from edge_agent.errors import ConnectionLost, EdgeError, TokenizerMismatch
from edge_agent.transport import ModelInfo, Transport
from edge_agent.sampled_tree import SampledTreeSession
from edge_agent.tree_builder import TreeConfig
from edge_agent.verify_policy import PolicyStore, VerifyPolicy

log = logging.getLogger("edge_agent")
MODES = ("proactive", "stop-and-wait")
VERIFY_RULES = ("match", "rejection", "tree-rejection", "auto")  # see the module docstring
MAX_GUESSES = 16  # AgentConfig.guesses, at most


@dataclass
class AgentConfig:
    mode: str = "proactive"
    depth_policy: str = "auto"  # fixed | server | flexspec | auto (see edge_agent.depth)
    depth: int = 4  # fixed depth / default before measurements
    max_depth: int = 12  # cap of every policy (and of the server's limit)
    budget: int = 32  # draft-tree nodes (capped by the server's budget hint and limit)
    topk: int = 4  # children per expanded node (1 = chain drafting)
    max_expand: int = 8  # nodes fed per draft forward
    # proactive chain length cap; default: the round's depth + 1, the most the next tree can carry
    # (the chain's first token guesses the bonus, the rest become the next tree's first levels)
    proactive_max: int | None = None
    max_reopens: int = 16  # consecutive re-opens without a verified round before giving up
    max_overload_waits: int = 32  # 429s waited out (Retry-After) per request; the next one is raised
    open_deadline_s: float = 120.0  # a shed open is retried (Retry-After, jittered) within this, then raised
    ping_every: int = 16  # rounds between RTT pings (0 = only at open)
    check_tokenizer: bool = True
    send_confidence: bool = True  # one byte per node (cumulative draft log-prob): the server's truncation uses it
    # F_AHEAD (match rule, no early results): while the server's tree budget is 0 it may decode on past the
    # bonus in the forwards it runs anyway and reply with several tokens (docs/protocol.md, "Run-ahead")
    run_ahead: bool = True
    verify: str = "match"  # match | rejection (chains with q(x)) | tree-rejection (sampled trees with q) | auto
    # the target version to verify against (FlexSpec: a LoRA fine-tune of the base; None: the base); one
    # agent, one version, so its telemetry (and its FlexSpec depth rule) sees that version's acceptance only
    model: str | None = None
    # early-exit pre-drafting (edge_agent/predraft.py): when the server streams early results, draft the
    # next tree from each during the round and send it at once when the reply matches (match rule only)
    predraft: bool = False
    # proactive mode, match rule, no early results: next trees drafted during a round for its likeliest
    # outcomes by the draft's own estimate (edge_agent/predraft.py), before SpecEdge §4.2's chain; 0 = the
    # chain only. Off by default: on the embedded pair 6 guesses hit 26% of rounds for ~7x the edge's draft
    # forwards, and one session's ITL did not move (docs/benchmarks.md, "Guesses")
    guesses: int = 0
    # verify="auto": a JSON file keeping the measured acceptance per (target, draft) pair across
    # processes (edge_agent.verify_policy.PolicyStore); None keeps it in this agent's memory only
    verify_state: str | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.verify not in VERIFY_RULES:
            raise ValueError(f"verify must be one of {VERIFY_RULES}, got {self.verify!r}")
        if not 0 <= self.guesses <= MAX_GUESSES:
            raise ValueError(f"guesses must be 0..{MAX_GUESSES}, got {self.guesses}")
        DepthPolicy(self.depth_policy)  # validates the name


@dataclass
class GenerationStats:
    """One generation, observed at the edge (vLLM spec-decode vocabulary)."""

    tokens: int = 0  # generated tokens
    seconds: float = 0.0  # open .. last token
    ttft_s: float = 0.0  # time to the first token
    rounds: int = 0  # verify rounds (num_drafts)
    draft_tokens: int = 0  # nodes sent (num_draft_tokens)
    verified_nodes: int = 0  # nodes the server verified (fewer than sent when it truncated a tree)
    accepted_tokens: int = 0  # accepted draft nodes (num_accepted_tokens)
    ahead_tokens: int = 0  # tokens the server decoded past the bonus (run-ahead)
    draft_forwards: int = 0  # forwards that built the sent trees
    proactive_forwards: int = 0
    align_attempts: int = 0  # rounds with a proactive token in hand when the reply came
    aligned: int = 0  # complete draft alignments
    reused_tokens: int = 0  # proactive tokens carried into the next tree
    reopens: int = 0
    overload_waits: int = 0
    rejections: int = 0  # rejection rule: rounds that ended in a residual sample at the edge
    refills: int = 0  # rejection rule: round trips for more residual candidates (no forward)
    verify_rule: str = ""  # the rule this generation used (match | rejection | tree-rejection)
    depth_sum: int = 0
    rtt_ms: list[float] = field(default_factory=list)  # network RTT samples (pings)
    round_ms: list[float] = field(default_factory=list)  # send -> reply of each verify
    draft_ms: list[float] = field(default_factory=list)  # each draft forward
    finish_reason: str | None = None
    early_asks: int = 0  # rounds that asked for early results (F_EARLY: a tree, the server has exits)
    early_frames: int = 0  # early results received (pre-draft cache, edge_agent/predraft.py)
    predraft_hits: int = 0  # rounds whose next tree was pre-drafted for a matching early result or guess
    predraft_misses: int = 0  # rounds with early results or guesses, none matching the reply
    predraft_forwards: int = 0  # draft forwards spent on pre-drafts
    predraft_layer_sum: int = 0  # exit layer of each early-result hit
    predraft_early_hits: int = 0  # hits on early results (the rest were the edge's own guesses)
    predraft_guessed: int = 0  # entries from the edge's own guesses

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per round (the bonus not counted)."""
        return self.accepted_tokens / self.rounds if self.rounds else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per round including the bonus (vLLM: 1 + accepted / drafts)."""
        return 1.0 + self.mean_accepted if self.rounds else 0.0

    @property
    def alignment_rate(self) -> float:
        return self.aligned / self.align_attempts if self.align_attempts else 0.0

    @staticmethod
    def _mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    @property
    def mean_rtt_ms(self) -> float:
        return self._mean(self.rtt_ms)

    @property
    def mean_round_ms(self) -> float:
        return self._mean(self.round_ms)

    @property
    def mean_draft_ms(self) -> float:
        return self._mean(self.draft_ms)

    @property
    def mean_depth(self) -> float:
        return self.depth_sum / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if not isinstance(v, list)}
        d.update(tokens_per_s=self.tokens_per_s, mean_accepted=self.mean_accepted,
                 mean_acceptance_length=self.mean_acceptance_length, alignment_rate=self.alignment_rate,
                 mean_rtt_ms=self.mean_rtt_ms, mean_round_ms=self.mean_round_ms,
                 mean_draft_ms=self.mean_draft_ms, mean_depth=self.mean_depth)
        return d

    def summary(self) -> str:
        return (f"{self.tokens} tokens in {self.seconds:.2f} s, {self.tokens_per_s:.1f} tok/s, "
                f"{self.mean_accepted:.2f} accepted/round over {self.rounds} rounds, "
                f"alignment {100 * self.alignment_rate:.0f}% ({self.aligned}/{self.align_attempts}), "
                f"RTT {self.mean_rtt_ms:.1f} ms, round {self.mean_round_ms:.1f} ms, "
                f"draft {self.mean_draft_ms:.1f} ms/forward"
                + (f", {self.early_frames} early frames" if self.early_frames else "")
                + (f", pre-draft hits {self.predraft_hits}/{self.predraft_hits + self.predraft_misses}"
                   if self.predraft_hits + self.predraft_misses else "")
                + (f", {self.rejections} rejections" if self.rejections else ""))


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens (stop token included, as the target emits it)
    text: str | None
    stats: GenerationStats
    prompt_ids: list[int] = field(default_factory=list)


class TextStream:
    """Incremental detokenization: emits text only once it is stable (no partial UTF-8)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.emitted = 0  # characters already emitted

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tok.decode(self.ids, skip_special_tokens=self.skip)
        if text.endswith("\ufffd"):
            return ""
        out, self.emitted = text[self.emitted:], len(text)
        return out

    def text(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=self.skip)


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation (``[{"role": ..., "content": ...}, ...]``) through the chat template, ready for the reply."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys") and "input_ids" in ids:  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def encode_prompt(tokenizer, prompt: str, chat: bool = False) -> list[int]:
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": prompt}])
    return [int(t) for t in tokenizer.encode(prompt)]


class EdgeAgent:
    """Speculative decoding with a local draft and a remote (or in-process) verifier.

    One agent runs one generation at a time (its drafter holds one KV cache); run many
    agents for concurrency.
    """

    def __init__(self, transport: Transport, drafter: Drafter, tokenizer=None,
                 config: AgentConfig | None = None, agent_name: str = "edge-agent/0.1",
                 draft_executor: DraftExecutor | None = None):
        self.transport = transport
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.config = config or AgentConfig()
        self.agent_name = agent_name
        self.policy = DepthPolicy(self.config.depth_policy, self.config.depth, self.config.max_depth)
        self.telemetry = Telemetry()  # persists across generations: the link and draft do not change
        self.verify_policy = VerifyPolicy()  # verify="auto": the rule per request, from measured acceptance
        self._store = (PolicyStore(Path(self.config.verify_state))
                       if self.config.verify == "auto" and self.config.verify_state else None)
        self._store_pair: str | None = None  # "target|draft": the stored entry this agent learns into
        self._info: ModelInfo | None = None
        # sessions the server closes with their finishing reply (close_on_finish) -> whether it came
        self._closes_itself: dict[str, bool] = {}
        # draft forwards run on a worker thread; agents sharing one device share one executor
        # (critical trees first, proactive work withdrawn once its reply is in)
        self._owns_drafts = draft_executor is None
        self._drafts = draft_executor or DraftExecutor()

    def close(self) -> None:
        if self._owns_drafts:
            self._drafts.shutdown()

    @property
    def draft_name(self) -> str:
        return getattr(self.drafter, "name", type(self.drafter).__name__)

    @property
    def draft_class(self) -> str:
        """What the replica keeps this agent's acceptance estimates under (``ClientInfo.draft``):
        the draft and how the agent builds its trees, which set how many tokens a tree brings."""
        c = self.config
        return f"{self.draft_name}/{c.mode}/{c.depth_policy}{'/predraft' if c.predraft else ''}"[:128]

    # -- setup ---------------------------------------------------------------------------
    async def model_info(self) -> ModelInfo:
        if self._info is None:
            self._info = await self.transport.model_info()
            self._check_compat(self._info)
            if self._store is not None:  # acceptance belongs to the (target, draft) pair
                self._store_pair = f"{self._info.model}|{self.draft_name}"
                self._store.load(self._store_pair, self.verify_policy)
        return self._info

    def _check_compat(self, info: ModelInfo) -> None:
        if not self.config.check_tokenizer:
            return
        from specdec.model.loading import tokenizer_fingerprint

        mine = tokenizer_fingerprint(self.tokenizer)
        if self.tokenizer is not None and info.tokenizer_fingerprint not in ("none", mine):
            raise TokenizerMismatch(
                f"the draft's tokenizer (fingerprint {mine}) differs from the target's "
                f"({info.tokenizer_fingerprint}, model {info.model}): use a draft that shares the target's tokenizer")
        dv = getattr(self.drafter, "vocab_size", None)
        if dv is not None and dv != info.vocab_size and getattr(self.drafter, "vocab_map", None) is None:
            raise TokenizerMismatch(f"the draft's vocabulary has {dv} tokens, the target's {info.vocab_size}")
        vm = getattr(self.drafter, "vocab_map", None)
        if vm is not None and int(vm.max()) >= info.vocab_size:
            raise TokenizerMismatch("the draft's vocab_map points outside the target vocabulary")

    def _proactive_cap(self, depth: int) -> int:
        """Proactive tokens worth drafting while a round of ``depth`` levels is away (SpecEdge
        §4.2): the bonus guess plus the next tree's levels. Deeper chains are only kept when
        every level aligns, and they cost the edge's power (and, sharing a host, its neighbour's
        memory bandwidth)."""
        return self.config.proactive_max or min(depth + 1, self.config.max_depth)

    async def _run(self, fn, *args):
        """A draft forward the session's next request waits for."""
        return await self._drafts.run(CRITICAL, fn, *args)

    async def _open(self, prompt: list[int], generated: list[int], params: SamplingParams,
                    stats: GenerationStats) -> SessionOpened:
        from specdec.model.loading import tokenizer_fingerprint

        t = self.telemetry
        req = OpenSession(prompt_ids=prompt, generated_ids=generated, sampling=params.to_dict(), model=self.config.model,
                          # without a tokenizer the edge cannot vouch for one (ids-only clients)
                          client=ClientInfo(tokenizer_fingerprint=(tokenizer_fingerprint(self.tokenizer)
                                                                   if self.tokenizer is not None else None),
                                            draft_ms=t.draft_ms.get(0.0), rtt_ms=t.rtt_ms.get(0.0),
                                            agent=self.agent_name, draft=self.draft_class,
                                            # our first round then asks for run-ahead if the hint is 0
                                            run_ahead=self.config.run_ahead and stats.verify_rule == "match"),
                          close_on_finish=True)  # no close round trip before the next open
        t0 = time.monotonic()
        for attempt in range(self.config.max_overload_waits + 1):
            try:
                sess = await self.transport.open(req)
                if sess.close_on_finish:
                    self._closes_itself[sess.session_id] = sess.finished
                return sess
            except Overloaded as e:
                wait = e.retry_after * (1 + random.random() / 2)  # jitter: shed agents do not return together
                spent = time.monotonic() - t0
                if attempt == self.config.max_overload_waits or spent + wait > self.config.open_deadline_s:
                    raise Overloaded(f"the cloud shed this open {attempt + 1} times in {spent:.1f} s ({e.reason}); "
                                     f"gave up within the agent's open deadline of {self.config.open_deadline_s:g} s",
                                     retry_after=e.retry_after, reason=e.reason) from None
                stats.overload_waits += 1
                await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    async def _ping(self, stats: GenerationStats) -> None:
        try:
            s = await self.transport.ping()
        except (EdgeError, OSError):
            return
        self.telemetry.observe_rtt(s)
        stats.rtt_ms.append(s * 1e3)

    # -- generation ----------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], sampling: SamplingParams | dict | None = None, *,
                       chat: bool = False, on_tokens: Callable[[list[int]], None] | None = None,
                       on_text: Callable[[str], None] | None = None,
                       on_logprobs: Callable[[list], None] | None = None) -> GenerationResult:
        """Generate from ``prompt`` (text needs a tokenizer); returns ids, text and stats.

        ``on_tokens`` gets each verified batch of token ids, ``on_text`` the new text; when the
        sampling asks for ``logprobs``, ``on_logprobs`` gets the batch's target log-probs
        (:class:`~specdec.protocol.TokenLogprob`, one per token) just before ``on_tokens``.
        """
        cfg = self.config
        info = await self.model_info()
        params = sampling if isinstance(sampling, SamplingParams) else SamplingParams.from_dict(sampling)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise EdgeError("a text prompt needs a tokenizer; pass token ids instead")
            prompt_ids = encode_prompt(self.tokenizer, prompt, chat)
        else:
            prompt_ids = [int(t) for t in prompt]
        stream = TextStream(self.tokenizer) if self.tokenizer is not None else None
        stats = GenerationStats()
        generated: list[int] = []

        def emit(toks: list[int], logprobs: list | None = None) -> None:
            if not toks:
                return
            if on_logprobs is not None and logprobs is not None:
                on_logprobs(logprobs)
            generated.extend(toks)
            if on_tokens is not None:
                on_tokens(toks)
            if stream is not None:
                piece = stream.push(toks)
                if piece and on_text is not None:
                    on_text(piece)

        t_start = time.perf_counter()
        if self.telemetry.rtt_ms.value is None:  # the first generation measures the link first
            await self._ping(stats)
        rule = self.verify_policy.choose(params) if cfg.verify == "auto" else cfg.verify
        if rule == "tree-rejection" and params.greedy:
            rule = "match"  # a point-mass target accepts the argmax's child whatever the rule: SpecExec trees
        if rule == "rejection" and params.logprobs is not None:
            rule = "match"  # a chain's rejected token is the edge's sample: the server has log-probs for trees only
        stats.verify_rule = rule
        sess = await self._open(prompt_ids, [], params, stats)
        stats.ttft_s = time.perf_counter() - t_start
        if sess.first_token is not None:
            emit([sess.first_token], [TokenLogprob.from_dict(sess.first_logprob)] if sess.first_logprob else None)
        finished, finish_reason = sess.finished, sess.finish_reason
        if rule == "rejection":
            if not finished:
                finish_reason = await self._rejection_rounds(info, params, prompt_ids, generated, emit, stats, sess)
            return self._done(params, prompt_ids, generated, stream, stats, t_start, finish_reason)
        depth_hint, budget_hint = sess.depth_hint, sess.budget_hint
        if rule == "tree-rejection":
            ds = SampledTreeSession(self.drafter, info.vocab_size, params, self._edge_generator(params),
                                    self._tree_config(info, budget_hint))
        else:
            ds = DraftSession(self.drafter, self._tree_config(info, budget_hint))
        ds.start(prompt_ids + generated)
        early = cfg.predraft and bool(info.early_exit_layers) and rule == "match"
        guessing = cfg.guesses > 0 and cfg.mode == "proactive" and rule == "match" and not early
        pc = PreDraftCache(ds, max_entries=cfg.guesses) if guessing else PreDraftCache(ds) if early else None
        last_verified: int | None = None  # nodes the server verified of the last tree (it truncates by prefix)
        predrafted = 0  # forwards the next tree already has (a pre-draft cache hit)
        sid = sess.session_id
        ping_task: asyncio.Task | None = None
        stalled = 0
        try:
            while not finished:
                if cfg.ping_every and stats.rounds and stats.rounds % cfg.ping_every == 0 and ping_task is None:
                    ping_task = asyncio.create_task(self._ping(stats))
                tree_cfg = self._tree_config(info, budget_hint)
                ds.set_config(tree_cfg)
                npl = max(1.0, min(tree_cfg.budget / max(self.policy.depth, 1), tree_cfg.max_expand * tree_cfg.topk))
                depth = self.policy.choose(self.telemetry, depth_hint, npl, stats.rounds)
                remaining = params.max_tokens - len(generated)
                depth = max(0, min(depth, remaining - 1, tree_cfg.max_depth))
                if budget_hint == 0:  # the server says trees do not pay now: plain decoding
                    depth = 0
                n_fwd0 = len(ds.forward_times)
                await self._run(ds.draft, depth - predrafted)
                proactive = cfg.mode == "proactive" and budget_hint != 0 and rule == "match"
                tree, order = ds.freeze(max_chain=self._proactive_cap(depth) if proactive else 0)
                self._observe_drafts(ds, n_fwd0, stats)
                stats.draft_forwards += len(ds.forward_times) - n_fwd0
                t = self.telemetry
                frame = VerifyFrame(prefix_len=len(prompt_ids) + len(generated), tokens=list(tree.tokens),
                                    parents=list(tree.parents), draft_ms=t.draft_ms.get(0.0),
                                    rtt_ms=t.rtt_ms.get(0.0), depth=ds.forwards,
                                    conf=ds.confidences(order) if cfg.send_confidence and len(tree) else None,
                                    proposals=ds.proposals(), early=early and len(tree) > 0)
                frame.ahead = cfg.run_ahead and rule == "match" and not frame.early
                stats.early_asks += frame.early
                t0 = time.perf_counter()
                guess_nodes = None  # the edge's own guesses: how many nodes of this tree it expects verified
                if guessing and proactive and len(tree):
                    guess_nodes = len(tree) if last_verified is None else min(last_verified, len(tree))
                if frame.early or guess_nodes is not None:  # pre-drafts first, proactive drafting in between
                    pc.begin_round(frame.prefix_len, ds.builder.forwards, guess_nodes)
                    task = await self._send_and_predraft(sid, frame, stats, ds, pc, proactive)
                else:
                    task = await self._send_and_draft(sid, frame, stats, ds, ds.proactive_step if proactive else None)
                predrafted = 0
                reply, sess = await self._reply_or_reopen(task, sid, stalled, prompt_ids, generated, params, stats)
                if sess is not None:
                    stalled += 1  # re-opens since the last verified round
                    sid = sess.session_id
                    finished, finish_reason = sess.finished, sess.finish_reason
                    depth_hint, budget_hint = sess.depth_hint or depth_hint, sess.budget_hint
                    ds.start(prompt_ids + generated)
                    continue
                round_ms = (time.perf_counter() - t0) * 1e3
                stalled = 0
                if reply.prefix_len != len(prompt_ids) + len(generated) + reply.emitted or (
                        reply.ahead and not frame.ahead):
                    raise EdgeError(f"reply prefix length {reply.prefix_len} does not match the history")
                emitted = reply.tokens(list(tree.tokens))
                # a run-ahead reply's prefix goes past every outcome the cache drafted for: never a hit
                hit = pc.take(list(reply.accepted), None if reply.ahead else reply.bonus) if pc is not None else None
                if hit is not None:  # the pre-draft cache holds this outcome's next tree, drafted already
                    al = Alignment(bool(ds.chain), False, 0)
                    pc.install(hit)
                    predrafted = hit.builder.forwards
                else:  # a miss: proactive alignment or a fresh tree, as without early results
                    al = ds.on_reply(list(reply.accepted), reply.bonus, emitted)
                emit(emitted, reply.token_logprobs(list(tree.tokens)))
                stats.rounds += 1
                verified = len(tree) if reply.verified is None else reply.verified  # the server may cut a prefix
                if len(tree):
                    last_verified = verified
                stats.draft_tokens += len(tree)
                stats.verified_nodes += verified
                stats.accepted_tokens += len(reply.accepted)
                stats.ahead_tokens += len(reply.ahead)
                stats.depth_sum += tree.depth
                stats.round_ms.append(round_ms)
                stats.align_attempts += al.attempted
                stats.aligned += al.aligned
                stats.reused_tokens += al.reused
                if not reply.ahead:  # a run-ahead round's time is several forwards: not a round's server time
                    self.telemetry.observe_round(tree.depth, len(reply.accepted), verified, round_ms)
                depth_hint = reply.depth_hint or depth_hint
                budget_hint = reply.budget_hint
                finished, finish_reason = reply.finished, reply.finish_reason
                if ping_task is not None and ping_task.done():
                    ping_task = None
        finally:
            if ping_task is not None:
                ping_task.cancel()
            await self._safe_close(sid)
            if pc is not None:
                s = pc.stats
                stats.early_frames, stats.predraft_hits, stats.predraft_misses = s.early_frames, s.hits, s.misses
                stats.predraft_forwards, stats.predraft_layer_sum = s.forwards, s.layer_sum
                stats.predraft_early_hits, stats.predraft_guessed = s.early_hits, s.guessed
        return self._done(params, prompt_ids, generated, stream, stats, t_start, finish_reason)

    def _done(self, params: SamplingParams, *args) -> GenerationResult:
        """The result; the verify policy learns the rule's acceptance from it: each round gives its
        accepted tokens and one more (the bonus or the residual sample); refills are round trips too."""
        res = self._result(*args)
        st = res.stats
        self.verify_policy.observe(st.verify_rule, params, tokens=st.accepted_tokens + st.rounds,
                                   rounds=st.rounds + st.refills)
        if self._store is not None and self._store_pair is not None and not params.greedy:
            try:
                self._store.save(self._store_pair, self.verify_policy)
            except OSError as e:  # the state file is a cache: a generation never fails on it
                log.warning("cannot write the verify policy's state file %s: %s", self._store.path, e)
        return res

    @staticmethod
    def _result(prompt_ids, generated, stream, stats: GenerationStats, t_start: float,
                finish_reason: str | None) -> GenerationResult:
        stats.tokens = len(generated)
        stats.seconds = time.perf_counter() - t_start
        stats.finish_reason = finish_reason
        text = stream.text() if stream is not None else None
        return GenerationResult(generated, text, stats, prompt_ids)

    async def _reply_or_reopen(self, task: asyncio.Task, sid: str, stalled: int, prompt_ids: list[int],
                               generated: list[int], params: SamplingParams, stats: GenerationStats):
        """(the round's reply, None), or, when the session was lost (evicted, unknown, a broken
        connection, a prefix mismatch), (None, the session re-opened from the edge's history);
        ``stalled`` re-opens in a row already: past ``max_reopens`` the loss is raised."""
        try:
            return await task, None
        except (SessionEvicted, SessionNotFound, ConnectionLost, PrefixMismatch):
            if stalled + 1 > self.config.max_reopens:
                raise
            return None, await self._reopen(sid, prompt_ids, generated, params, stats, stalled + 1)

    async def _reopen(self, sid: str, prompt_ids: list[int], generated: list[int], params: SamplingParams,
                      stats: GenerationStats, stalled: int) -> SessionOpened:
        """Re-open a lost session from the edge's history (backing off when it keeps failing)."""
        stats.reopens += 1
        await self._safe_close(sid)
        if stalled > 1:  # evicted again before any progress: back off (a thrashing KV budget)
            await asyncio.sleep(min(0.05 * 2 ** (stalled - 2), 2.0) * (0.5 + random.random()))
        sess = await self._open(prompt_ids, list(generated), params, stats)
        if sess.prefix_len != len(prompt_ids) + len(generated):
            raise EdgeError(f"re-opened session has prefix {sess.prefix_len}, expected "
                            f"{len(prompt_ids) + len(generated)}")
        return sess

    def _edge_generator(self, params: SamplingParams) -> torch.Generator | None:
        """The edge's own randomness (draft samples, residual samples), independent of the
        server's. With a seed, a run repeats exactly when its rounds do not depend on timing
        (stop-and-wait, fixed depth); the output distribution is the target's in every case."""
        if params.greedy:
            return None
        g = torch.Generator()
        g.manual_seed((params.seed ^ 0x5EED_ED6E) if params.seed is not None else int(torch.randint(0, 2**62, ())))
        return g

    async def _rejection_rounds(self, info: ModelInfo, params: SamplingParams, prompt_ids: list[int],
                                generated: list[int], emit, stats: GenerationStats, sess: SessionOpened) -> str | None:
        """Rounds of the rejection rule until the session finishes; returns the finish reason.

        A round: draft a chain (x_i ~ q_i), send it with q_i(x_i) and the token owed from the
        last rejection, proactively extend the chain while waiting, apply the reply: accepted
        tokens, then the bonus, or on a rejection a residual sample drawn here (asking for more
        tail candidates while they run out). The owed token is emitted at once; the server
        learns it with the next frame.
        """
        cfg = self.config
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(info.eos_token_ids))
        cs = ChainDraftSession(self.drafter, info.vocab_size, params, self._edge_generator(params))
        cs.start(prompt_ids + generated)
        sid = sess.session_id
        depth_hint, budget_hint = sess.depth_hint, sess.budget_hint
        owed: int | None = None  # the residual sample the server has not seen yet (it is in ``generated``)
        pending: ResidualSampler | None = None  # a rejection whose residual sample is not drawn yet
        ping_task: asyncio.Task | None = None
        stalled = 0
        try:
            while True:
                if cfg.ping_every and stats.rounds and stats.rounds % cfg.ping_every == 0 and ping_task is None:
                    ping_task = asyncio.create_task(self._ping(stats))
                if ping_task is not None and ping_task.done():
                    ping_task = None
                t = self.telemetry
                base = len(prompt_ids) + len(generated)
                if pending is not None:  # the residual's tail candidates ran out: ask for more (no draft)
                    frame = VerifyFrame(prefix_len=base + 1, tokens=[], parents=[], q=[], more=True,
                                        draft_ms=t.draft_ms.get(0.0), rtt_ms=t.rtt_ms.get(0.0))
                    try:
                        reply = await self._verify(sid, frame, stats)
                    except (SessionEvicted, SessionNotFound, ConnectionLost, PrefixMismatch):
                        stalled += 1  # re-opens since the last verified round
                        if stalled > cfg.max_reopens:
                            raise
                        sess = await self._reopen(sid, prompt_ids, generated, params, stats, stalled)
                        sid = sess.session_id  # the new session answers with a whole new rejection
                        continue
                    stats.refills += 1
                    if not reply.rejected:
                        raise EdgeError("the server answered a request for residual candidates without them")
                    if reply.reject_top_ids:  # a re-opened session sent a whole new rejection
                        pending.reset(_rejection(reply))
                    else:
                        pending.extend(_rejection(reply))
                    tok = pending.sample()
                    if tok is not None:
                        pending, owed = None, tok
                        emit([tok])
                        cs.start(prompt_ids + generated)
                        if self._ends(tok, stops, generated, params):
                            return await self._send_owed(sid, base + 1, owed, stats)
                    continue
                remaining = params.max_tokens - len(generated)
                npl = 1.0  # a chain: one node per level
                depth = self.policy.choose(self.telemetry, depth_hint, npl, stats.rounds)
                cap = min(cfg.max_depth, info.max_tree_depth, info.max_tree_nodes, cfg.budget,
                          budget_hint or cfg.budget)
                depth = max(0, min(depth, remaining - 1, cap))
                if budget_hint == 0:  # the server says drafts do not pay now: plain decoding
                    depth = 0
                n_fwd0 = len(cs.forward_times)
                await self._run(cs.draft, depth)
                send = 0 if depth == 0 else min(max(depth, len(cs.chain)), remaining - 1, cap)
                tokens, qs = cs.freeze(send)
                self._observe_drafts(cs, n_fwd0, stats)
                stats.draft_forwards += len(cs.forward_times) - n_fwd0
                frame = VerifyFrame(prefix_len=base, tokens=tokens, parents=list(range(-1, len(tokens) - 1)),
                                    q=qs, resampled=owed, draft_ms=t.draft_ms.get(0.0), rtt_ms=t.rtt_ms.get(0.0),
                                    depth=cs.forwards)
                t0 = time.perf_counter()
                proactive = cfg.mode == "proactive" and budget_hint != 0
                task = await self._send_and_draft(sid, frame, stats, cs, cs.proactive_step if proactive else None,
                                                  self._proactive_cap(depth))
                reply, sess = await self._reply_or_reopen(task, sid, stalled, prompt_ids, generated, params, stats)
                if sess is not None:
                    stalled += 1  # re-opens since the last verified round
                    sid, owed = sess.session_id, None  # the owed token is in the history now
                    if sess.finished:
                        return sess.finish_reason
                    depth_hint, budget_hint = sess.depth_hint or depth_hint, sess.budget_hint
                    cs.start(prompt_ids + generated)
                    continue
                round_ms = (time.perf_counter() - t0) * 1e3
                stalled = 0
                n_acc = len(reply.accepted)
                if reply.ahead or reply.accepted != list(range(n_acc)) or n_acc > len(tokens) or (
                        reply.prefix_len != base + n_acc + (not reply.finished or reply.bonus is not None)):
                    raise EdgeError(f"reply (prefix length {reply.prefix_len}, {n_acc} accepted) does not match "
                                    "the chain sent")
                owed = None
                stats.rounds += 1
                stats.draft_tokens += len(tokens)
                stats.verified_nodes += len(tokens)
                stats.accepted_tokens += n_acc
                stats.depth_sum += len(tokens)
                stats.round_ms.append(round_ms)
                self.telemetry.observe_round(len(tokens), n_acc, len(tokens), round_ms)
                depth_hint = reply.depth_hint or depth_hint
                budget_hint = reply.budget_hint
                if reply.rejected:
                    stats.rejections += 1
                    sampler = ResidualSampler(_rejection(reply), cs.q_at(n_acc), cs.generator)
                    emit(tokens[:n_acc])
                    cs.on_reply(n_acc, None)
                    tok = sampler.sample()
                    if tok is None:
                        pending = sampler
                        continue
                    owed = tok
                    emit([tok])
                    cs.start(prompt_ids + generated)
                    if self._ends(tok, stops, generated, params):
                        return await self._send_owed(sid, reply.prefix_len, owed, stats)
                    continue
                al = cs.on_reply(n_acc, reply.bonus)
                emit(tokens[:n_acc] + ([reply.bonus] if reply.bonus is not None else []))
                stats.align_attempts += al.attempted
                stats.aligned += al.aligned
                stats.reused_tokens += al.reused
                if reply.finished:
                    return reply.finish_reason
        finally:
            if ping_task is not None:
                ping_task.cancel()
            await self._safe_close(sid)

    @staticmethod
    def _ends(tok: int, stops: set[int], generated: list[int], params: SamplingParams) -> bool:
        return tok in stops or len(generated) >= params.max_tokens

    async def _send_owed(self, sid: str, prefix_len: int, owed: int, stats: GenerationStats) -> str | None:
        """The owed token ends the generation: tell the server (an empty chain), for its finish reason."""
        try:
            reply = await self._verify(sid, VerifyFrame(prefix_len=prefix_len, tokens=[], parents=[], q=[],
                                                        resampled=owed), stats)
        except (SessionEvicted, SessionNotFound, ConnectionLost, PrefixMismatch):
            return None  # the output is complete either way
        return reply.finish_reason

    def _tree_config(self, info: ModelInfo, budget_hint: int) -> TreeConfig:
        cfg = self.config
        budget = min(cfg.budget, info.max_tree_nodes, budget_hint)
        return TreeConfig(budget=max(1, budget), topk=cfg.topk, max_expand=cfg.max_expand,
                          max_depth=min(cfg.max_depth, info.max_tree_depth))

    async def _send_and_draft(self, sid: str, frame: VerifyFrame, stats: GenerationStats, session, step=None,
                              *args) -> asyncio.Task:
        """Send ``frame``; while its reply is on the way, run ``step(*args)`` (proactive
        drafting, SpecEdge §4.2) until it has nothing more to do. Returns the verify task."""
        task = asyncio.create_task(self._verify(sid, frame, stats))
        if step is not None:
            n0 = len(session.forward_times)
            while not task.done():
                ran, more = await self._drafts.run_until(task, step, *args)
                if not (ran and more):
                    break
            stats.proactive_forwards += len(session.forward_times) - n0
            self._observe_drafts(session, n0, stats)
        return task

    async def _send_and_predraft(self, sid: str, frame: VerifyFrame, stats: GenerationStats, ds: DraftSession,
                                 pc: PreDraftCache, proactive: bool) -> asyncio.Task:
        """Send ``frame`` (asking for early results when ``frame.early``); while its reply is on the
        way, pre-draft from the round's guesses and each early result as it arrives (most
        confident first), and extend the proactive chain when there is none to work on (the
        early-exit paper's Algorithm 1 over SpecEdge §4.2)."""
        wake = asyncio.Event()

        def on_early(f) -> None:
            if pc.offer(f):
                wake.set()

        task = asyncio.create_task(self._verify(sid, frame, stats, on_early if frame.early else None))
        n0, p0 = len(ds.forward_times), pc.stats.forwards
        chain = proactive
        while not task.done():
            wake.clear()  # before the checks: an early result from now on wakes the wait below
            if pc.pending():
                await self._drafts.run_until(task, pc.step)
                continue
            if chain and pc.room() > 1:  # the chain and the pre-drafts share the draft's tree bits
                ran, more = await self._drafts.run_until(task, ds.proactive_step)
                chain = more if ran else chain  # withdrawn: the reply is in, the loop ends
                continue
            waiter = asyncio.ensure_future(wake.wait())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        stats.proactive_forwards += len(ds.forward_times) - n0 - (pc.stats.forwards - p0)
        self._observe_drafts(ds, n0, stats)
        return task

    def _observe_drafts(self, ds: DraftSession | ChainDraftSession, start: int, stats: GenerationStats) -> None:
        for s in ds.forward_times[start:]:
            self.telemetry.observe_draft(s)
            stats.draft_ms.append(s * 1e3)

    async def _verify(self, sid: str, frame: VerifyFrame, stats: GenerationStats, on_early=None):
        for attempt in range(self.config.max_overload_waits + 1):
            try:
                if on_early is not None:  # early results (F_EARLY) go to the pre-draft cache
                    reply = await self.transport.verify(sid, frame, on_early=on_early)
                else:
                    reply = await self.transport.verify(sid, frame)
                if reply.finished and sid in self._closes_itself:
                    self._closes_itself[sid] = True
                return reply
            except Overloaded as e:  # not applied: resend the same frame later
                if attempt == self.config.max_overload_waits:
                    raise
                stats.overload_waits += 1
                await asyncio.sleep(e.retry_after)
        raise AssertionError("unreachable")

    async def _safe_close(self, sid: str) -> None:
        """End a session: the server closed it with its finishing reply (``close_on_finish``), so
        only this side's connection goes; else a close request (best effort: the server evicts
        idle sessions)."""
        try:
            if self._closes_itself.pop(sid, False):
                await self.transport.release(sid)
            else:
                await self.transport.close(sid)
        except Exception:  # noqa: BLE001
            pass


def _rejection(reply: ReplyFrame) -> Rejection:
    """The edge's half of a rejection reply (:mod:`specdec.acceptance`)."""
    return Rejection(tuple(reply.reject_top_ids), tuple(reply.reject_top_probs), reply.tail_mass,
                     tuple(reply.tail_ids), tuple(reply.tail_probs))
