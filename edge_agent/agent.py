"""The edge agent: draft locally, verify remotely, stream what the target accepts.

Guarantee: greedy output equals the target's; sampled output follows the target's distribution;
a lost session is re-opened from the edge's history (no token lost or duplicated).
Notes: docs/edge_agent.md, "edge_agent/agent.py"."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from edge_agent.config import AgentConfig
from edge_agent.depth import DepthPolicy, Telemetry
from edge_agent.draft_executor import DraftExecutor
from edge_agent.draft_backends import Drafter
from edge_agent.errors import EdgeError
from edge_agent.link import Client, SessionLink
from edge_agent.rounds import Edge, Generation
from edge_agent.rules import RULES
from edge_agent.stats import GenerationResult, GenerationStats
from edge_agent.transport.base import ModelInfo, Transport
from edge_agent.verify_policy import PolicyStore, VerifyPolicy
from specdec import clock
from specdec.errors import InvalidRequest, TokenizerMismatch
from specdec.openai import TextStream, chat_prompt
from specdec.protocol import TokenLogprob
from specdec.sampling import SamplingParams

__all__ = ["AgentConfig", "EdgeAgent", "GenerationResult", "GenerationStats", "DecodedStream", "encode_prompt"]
log = logging.getLogger("edge_agent")


class DecodedStream:
    """Token ids decoded as they come, the text released through :class:`specdec.openai.TextStream`
    (held back while a UTF-8 sequence is incomplete). Apart from it because it owns the ids and the
    decoding; stop strings are the server's."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self._out = TextStream()

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        return self._out.push(self.text(), final=False)[0]

    def text(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=self.skip)


def encode_prompt(tokenizer, prompt: str, chat: bool = False) -> list[int]:
    """``prompt`` as ids: one user message through the chat template (``chat``), else the bare text."""
    if chat:
        return chat_prompt([{"role": "user", "content": prompt}], tokenizer)
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
        self._grammars = None  # specdec.grammar.GrammarCompiler: the edge's own, for masked drafts
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

    # -- generation ----------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], sampling: SamplingParams | dict | None = None, *,
                       chat: bool = False, on_tokens: Callable[[list[int]], None] | None = None,
                       on_text: Callable[[str], None] | None = None,
                       on_logprobs: Callable[[list], None] | None = None, grammar=None) -> GenerationResult:
        """Generate from ``prompt`` (text needs a tokenizer); returns ids, text and stats; ``grammar``:
        a :class:`~specdec.grammar.GrammarSpec` the output follows (structured output).

        ``on_tokens`` gets each verified batch of token ids, ``on_text`` the new text; when the
        sampling asks for ``logprobs``, ``on_logprobs`` gets the batch's target log-probs
        (:class:`~specdec.protocol.TokenLogprob`, one per token) just before ``on_tokens``.
        """
        info = await self.model_info()
        params = sampling if isinstance(sampling, SamplingParams) else SamplingParams.from_dict(sampling)
        prompt_ids = self._prompt_ids(prompt, chat)
        stream = DecodedStream(self.tokenizer) if self.tokenizer is not None else None
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

        t_start = clock.perf_counter()
        link = SessionLink(self.transport, self.config, self.telemetry, self._client(), params, prompt_ids,
                           generated, stats, grammar.to_wire() if grammar is not None else None)
        if self.telemetry.rtt_ms.value is None:  # the first generation measures the link first
            await link.ping()
        stats.verify_rule = rule = self._rule(params)
        sess = await link.open()
        stats.ttft_s = clock.perf_counter() - t_start
        if sess.first_token is not None:
            emit([sess.first_token], [TokenLogprob.from_dict(sess.first_logprob)] if sess.first_logprob else None)
        edge = Edge(self.config, self._drafter_for(grammar, info, len(prompt_ids)), self.policy, self.telemetry,
                    self._drafts)
        gen = Generation(info, params, prompt_ids, generated, stats, emit)
        rounds = RULES.get(rule).rounds(edge, link, gen, sess)
        finish_reason = await rounds.run()
        return self._done(params, prompt_ids, generated, stream, stats, t_start, finish_reason)

    def _drafter_for(self, grammar, info, prompt_len: int):
        """The drafter of one generation: with a grammar and a tokenizer, one whose candidates follow
        it (:mod:`edge_agent.grammar_drafter`); the verifier masks the target either way."""
        if grammar is None or self.tokenizer is None:
            return self.drafter
        from edge_agent.grammar_drafter import GrammarDrafter
        from specdec.grammar import GrammarCompiler

        if self._grammars is None or self._grammars.vocab_size != info.vocab_size:
            self._grammars = GrammarCompiler(self.tokenizer, info.vocab_size, info.eos_token_ids)
        try:
            return GrammarDrafter(self.drafter, self._grammars.state(grammar), prompt_len)
        except InvalidRequest:  # the verifier took it (the open succeeded): draft unmasked
            return self.drafter

    def _prompt_ids(self, prompt: str | list[int], chat: bool) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise EdgeError("a text prompt needs a tokenizer; pass token ids instead")
            return encode_prompt(self.tokenizer, prompt, chat)
        return [int(t) for t in prompt]

    def _rule(self, params: SamplingParams) -> str:
        """The verify rule of this request (:mod:`edge_agent.rules`)."""
        rule = self.verify_policy.choose(params) if self.config.verify == "auto" else self.config.verify
        return RULES.get(rule).instead(params) or rule

    def _client(self) -> Client:
        from specdec.model.loading import tokenizer_fingerprint

        # without a tokenizer the edge cannot vouch for one (ids-only clients)
        fingerprint = tokenizer_fingerprint(self.tokenizer) if self.tokenizer is not None else None
        return Client(self.agent_name, self.draft_class, fingerprint)

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
        stats.seconds = clock.perf_counter() - t_start
        stats.finish_reason = finish_reason
        text = stream.text() if stream is not None else None
        return GenerationResult(generated, text, stats, prompt_ids)
