"""What a simulation is asked to serve: users, their devices, network and drafts (issue 61).

A YAML (or JSON) file of :class:`Workload`'s shape; unknown keys and impossible values are
refused with the field named, before anything is simulated. Acceptance is per tree level
(:class:`loadtests.synthetic_tree.AcceptanceModel`: the draft's top-1 right with ``alpha``, its
top-2 sibling with ``sibling_alpha``), stated or measured from a real draft/target pair.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from edge_agent.config import AgentConfig
from edge_agent.depth import POLICIES
from loadtests.config import DEVICE_DRAFT_MS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Network(_Strict):
    rtt_ms: float = Field(40.0, ge=0, le=10_000, description="median round trip of the users")
    rtt_sigma: float = Field(0.0, ge=0, le=2, description="log-normal spread of the users' RTTs")
    jitter: float = Field(0.2, ge=0, le=1, description="uniform +- fraction of each round's RTT and draft time")


class Acceptance(_Strict):
    alpha: float = Field(0.7, ge=0, le=1, description="P(draft top-1 = target token) per tree level")
    sibling_alpha: float = Field(0.3, ge=0, le=1, description="P(top-2 sibling = target token | top-1 wrong)")


class Fault(_Strict):
    """A seeded event of the run: a replica killed (and a new one started ``restart_after_s``
    later), an RTT spike, a burst of new users opening at once, users vanishing mid-generation."""

    at_s: float = Field(..., ge=0)
    kind: Literal["kill_replica", "rtt_spike", "burst", "vanish"]
    replica: int = Field(0, ge=0, description="kill_replica: which (by index)")
    restart_after_s: float | None = Field(5.0, ge=0, description="kill_replica: a new replica this much later")
    factor: float = Field(5.0, gt=0, le=1000, description="rtt_spike: every RTT times this")
    for_s: float = Field(10.0, gt=0, description="rtt_spike: for this long")
    users: int = Field(100, ge=1, le=1_000_000, description="burst: users that start at once")
    share: float = Field(0.1, gt=0, le=1, description="vanish: share of the users that drop their session, unclosed")


class Workload(_Strict):
    users: int = Field(100, ge=1, le=10_000_000)
    duration_s: float = Field(60.0, gt=0, le=86_400, description="simulated seconds of load")
    warmup_s: float = Field(5.0, ge=0, description="excluded from the steady-state figures")
    spawn_rate: float | None = Field(None, gt=0, description="users started per second; None: all at once")
    think_s: tuple[float, float] = Field((0.0, 0.0), description="uniform idle time between a user's generations")
    prompt_tokens: tuple[int, int] = Field((16, 64), description="uniform prompt length")
    prompt_lengths: list[int] | None = Field(None, min_length=1, description="prompt lengths dealt in order "
                                             "instead (benchmarks.run's deal): user i's g-th generation takes "
                                             "entry (g * users + i) modulo their number")
    max_tokens: int = Field(64, ge=1, le=1_000_000, description="tokens per generation")
    devices: dict[str, float] = Field(default_factory=lambda: {"rtx4090": 1.0},
                                      description="device class (DEVICE_DRAFT_MS, or draft_ms) -> share")
    draft_ms: dict[str, float] = Field(default_factory=dict, description="ms per draft forward of device "
                                                                          "classes beyond DEVICE_DRAFT_MS")
    client: Literal["edge_agent", "loadtest"] = Field("edge_agent", description="who sends the rounds: the edge "
                                                     "agent (its depth policy, pings and telemetry, its budget) or "
                                                     "the load test's Locust user (the server's hints, its own "
                                                     "draft ms and RTT)")
    depth: int | None = Field(None, ge=1, le=64, description="draft forwards per tree; None: the client's rule")
    depth_policy: str = Field(AgentConfig.depth_policy, pattern=f"^({'|'.join(POLICIES)})$",
                              description="the edge agent's depth rule (edge_agent.depth) when depth is None: "
                                          "under the server's depth hint, on the agent's own measurements")
    nodes: int | None = Field(None, ge=1, le=1024, description="tree nodes (the agent's, capped by the server's "
                                                               "budget hint: what its tree builder makes at its "
                                                               "depth); None: the agent's budget under the hint")
    budget: int = Field(AgentConfig.budget, ge=1, le=1024, description="the edge agent's tree budget "
                                                                        "(AgentConfig.budget) when nodes is None")
    network: Network = Field(default_factory=Network)
    acceptance: Acceptance = Field(default_factory=Acceptance)
    mode: str = Field("edge", pattern="^(edge|server_ar)$", description="edge-drafted trees, or decoding on "
                                                                        "the server (empty trees, no round trip "
                                                                        "between tokens: they stream)")
    generations_per_user: int | None = Field(None, ge=1, description="each user stops after this many (a closed "
                                                                     "run that ends when all have); None: until "
                                                                     "duration_s")
    proactive: bool = Field(False, description="SpecEdge §4.2 proactive drafting: the next tree is drafted while "
                                               "the current one is verified, used when the whole tree was accepted")
    run_ahead: bool = Field(True, description="edge rounds accept run-ahead replies (the agent's default): with no "
                                              "tree the server decodes on past the bonus")
    edge_workers: int | None = Field(None, ge=1, description="draft forwards of all users share this many workers "
                                                             "(one edge core serving every session, as "
                                                             "benchmarks.run does); None: a device per user")
    tenants: dict[str, float] = Field(default_factory=lambda: {"default": 1.0},
                                      description="tenant name -> share of the users")
    faults: list[Fault] = Field(default_factory=list, description="seeded events (sim/system.py)")
    max_gap_s: float = Field(30.0, gt=0, description="invariant: no running session waits longer than this "
                                                     "between two deliveries")
    share_tolerance: float = Field(0.2, gt=0, lt=1, description="invariant: two tenants left waiting by the same "
                                                                "forwards get forward tokens in their weights' "
                                                                "ratio within this (sim/fairness.py)")

    @model_validator(mode="after")
    def _check(self):
        for name, (lo, hi) in (("think_s", self.think_s), ("prompt_tokens", self.prompt_tokens)):
            if not 0 <= lo <= hi:
                raise ValueError(f"{name} must be [low, high] with 0 <= low <= high, got {[lo, hi]}")
        if self.prompt_tokens[0] < 1 or min(self.prompt_lengths or [1]) < 1:
            raise ValueError("prompt_tokens, prompt_lengths: a prompt has at least 1 token")
        for d, ms in self.draft_ms.items():
            if ms < 0:
                raise ValueError(f"draft_ms.{d}: ms per draft forward must be >= 0, got {ms}")
        known = {**DEVICE_DRAFT_MS, **self.draft_ms}
        for d, share in self.devices.items():
            if d not in known:
                raise ValueError(f"devices: unknown device class {d!r}; known: {sorted(known)} (or give draft_ms)")
            if not share > 0:
                raise ValueError(f"devices.{d}: a share must be > 0")
        if any(not v > 0 for v in self.tenants.values()) or not self.tenants:
            raise ValueError("tenants: shares must be > 0")
        if self.warmup_s >= self.duration_s:
            raise ValueError("warmup_s must be shorter than duration_s")
        return self

    def prompt_length(self, user: int, g: int, rng) -> int:
        """The prompt length of ``user``'s ``g``-th generation: dealt from ``prompt_lengths`` (as
        ``benchmarks.run`` deals its prompts, ``prompts[user::users]``), else drawn from ``prompt_tokens``."""
        if self.prompt_lengths:
            return self.prompt_lengths[(g * self.users + user) % len(self.prompt_lengths)]
        return rng.randint(*self.prompt_tokens)

    def device_ms(self) -> dict[str, float]:
        return {d: {**DEVICE_DRAFT_MS, **self.draft_ms}[d] for d in self.devices}

    @classmethod
    def load(cls, path: str | Path) -> "Workload":
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"workload {path}: cannot read it ({e})") from None
        try:
            return cls(**data)
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            field = ".".join(str(x) for x in err["loc"]) or "(top level)"
            raise ValueError(f"workload {path}: {field}: {err['msg']}") from None
        except TypeError as e:
            raise ValueError(f"workload {path}: must be a mapping of fields ({e})") from None
