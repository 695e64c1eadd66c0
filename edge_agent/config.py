"""The edge agent's configuration (one dataclass, validated): how it drafts, paces and verifies.
The verify rules are described in docs/edge_agent.md, "Verify rules"."""

from __future__ import annotations

from dataclasses import dataclass

from edge_agent.depth import DepthPolicy

MODES = ("proactive", "stop-and-wait")
VERIFY_RULES = ("match", "rejection", "tree-rejection", "auto")  # docs/edge_agent.md, "Verify rules"
REGISTERED_RULES: set[str] = set()  # rules other modules registered (edge_agent.rules.register)
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
        if self.verify not in VERIFY_RULES and self.verify not in REGISTERED_RULES:
            raise ValueError(f"verify must be one of {VERIFY_RULES} or a registered rule "
                             f"({sorted(REGISTERED_RULES)}), got {self.verify!r}")
        if not 0 <= self.guesses <= MAX_GUESSES:
            raise ValueError(f"guesses must be 0..{MAX_GUESSES}, got {self.guesses}")
        DepthPolicy(self.depth_policy)  # validates the name
