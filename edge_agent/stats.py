"""What one generation observed at the edge (:class:`GenerationStats`, vLLM spec-decode
vocabulary) and what it returns (:class:`GenerationResult`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
    round_tokens: int = 0  # tokens the rounds delivered: accepted, bonus or residual sample, run-ahead
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
    def tokens_per_round(self) -> float:
        """Tokens a verify round delivered (the open's first token is no round's)."""
        return self.round_tokens / self.rounds if self.rounds else 0.0

    @property
    def mean_ahead(self) -> float:
        """Run-ahead tokens per round (decoded by the server past the bonus)."""
        return self.ahead_tokens / self.rounds if self.rounds else 0.0

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
        d.update(tokens_per_s=self.tokens_per_s, tokens_per_round=self.tokens_per_round,
                 mean_accepted=self.mean_accepted, mean_ahead=self.mean_ahead,
                 mean_acceptance_length=self.mean_acceptance_length, alignment_rate=self.alignment_rate,
                 mean_rtt_ms=self.mean_rtt_ms, mean_round_ms=self.mean_round_ms,
                 mean_draft_ms=self.mean_draft_ms, mean_depth=self.mean_depth)
        return d

    def summary(self) -> str:
        return (f"{self.tokens} tokens in {self.seconds:.2f} s, {self.tokens_per_s:.1f} tok/s, "
                f"{self.tokens_per_round:.2f} tokens/round over {self.rounds} rounds (of which "
                f"{self.mean_accepted:.2f} drafted and accepted, {self.mean_ahead:.2f} run ahead), "
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
