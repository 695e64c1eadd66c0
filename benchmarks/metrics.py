"""Benchmark figures from raw observations: ITL percentiles, server cost, cost efficiency.

Definitions (SpecEdge §5 "Baseline and metrics", adapted to one CPU core per side):

- **server throughput**: verified tokens (the verifier's ``tokens_emitted``, first tokens
  included) per second of *verifier busy time* (seconds inside target forwards, plus, for
  the server-only SD baseline, the server-side drafter's CPU seconds), and per wall
  second of the measurement window.
  On a shared machine the busy time (wall clock inside forwards) also counts time the
  core was taken by other processes; ``server_tokens_per_cpu_s`` divides by the CPU seconds
  the engine process(es) (our verifier replica, plus the server-side drafter thread; vLLM's
  engine core and worker) actually got, from /proc.
- **whole-server cost** (``tokens_per_server_cpu_s``): the same tokens per CPU second of
  *every* process of the server (the process tree started for it on the server core: Serve's
  HTTP proxy, the router and verifier replicas, the Serve controller and Ray's own raylet, GCS
  and agents; for vLLM its API server, engine core and worker), from /proc over the window.
  This is what a platform pays for; peers without a verifier-busy clock (vLLM) have only this
  and the engine figure.
- **inter-token latency** as the user sees it: tokens arrive in batches (one per verify
  round); a batch of ``n`` tokens that lands ``g`` seconds after the previous one counts
  as ``n`` samples of ``g / n`` (so the mean is exactly the time per output token after
  the first); percentiles are weighted by those counts.
- **cost efficiency** (SpecEdge: "generated tokens per dollar"): server throughput per
  wall second x 3600 / (server $/h + edges x edge $/h). Prices as SpecEdge's: A100 40GB
  $4.05/h for the server, RTX 4090 $0.35/h per edge device (one per edge session; the
  server-only modes have none).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

SERVER_USD_PER_H = 4.05  # A100 40GB (SpecEdge §5)
EDGE_USD_PER_H = 0.35  # RTX 4090 from an edge cloud provider, per edge device (SpecEdge §5)


def itl_samples(arrivals: list[tuple[float, int]]) -> list[tuple[float, float]]:
    """``arrivals`` = (time s, tokens) per delivered batch, the first being the first token(s).

    -> (seconds per token, weight = tokens) for every batch after the first.
    """
    out = []
    for (t0, _), (t1, n) in zip(arrivals, arrivals[1:]):
        if n > 0:
            out.append(((t1 - t0) / n, float(n)))
    return out


def weighted_percentile(samples: list[tuple[float, float]], q: float) -> float:
    """The smallest value whose cumulative weight reaches ``q`` (0..100) of the total."""
    if not samples:
        return float("nan")
    xs = sorted(samples)
    total = sum(w for _, w in xs)
    target = q / 100.0 * total
    acc = 0.0
    for x, w in xs:
        acc += w
        if acc >= target - 1e-12:
            return x
    return xs[-1][0]


def weighted_mean(samples: list[tuple[float, float]]) -> float:
    total = sum(w for _, w in samples)
    return sum(x * w for x, w in samples) / total if total else float("nan")


def cost_efficiency_ktok_per_usd(tokens_per_s: float, edges: int, server_usd_h: float = SERVER_USD_PER_H,
                                 edge_usd_h: float = EDGE_USD_PER_H) -> float:
    """Thousands of generated tokens per dollar (SpecEdge Table 1)."""
    usd_per_s = (server_usd_h + edges * edge_usd_h) / 3600.0
    return tokens_per_s / usd_per_s / 1000.0 if usd_per_s > 0 else float("nan")


@dataclass
class Window:
    """What changed on the server and the wire during one configuration's run."""

    wall_s: float
    verifier_busy_s: float
    server_draft_cpu_s: float  # server-side drafter thread (server_sd only; 0 otherwise)
    tokens_emitted: int
    up_bytes: int
    down_bytes: int
    verifier_cpu_s: float = float("nan")  # CPU seconds of the engine process(es) (/proc)
    server_cpu_s: float = float("nan")  # CPU seconds of the whole server process tree (/proc)
    verify_forwards: int = 0  # the verifier's verify forwards (0: not known, e.g. vLLM)
    verify_sessions: int = 0  # session rounds in them
    verify_rows: int = 0  # token rows in them (roots + verified nodes + prefill chunks)
    prefill_tokens: int = 0  # prompt tokens the replica computed (prefill forwards and chunks in verify forwards)
    verify_requests: int = 0  # verify requests the replica answered
    verify_request_seconds: float = 0.0  # their seconds in the replica, arrival to reply (run-ahead: every step)
    forward_cpu_s_prefill: float = float("nan")  # CPU seconds of the forwards' own thread: prefill forwards
    forward_cpu_s_verify: float = float("nan")  # ... and verify forwards (verifier_busy_s minus these: preempted)
    takeovers_running: int = 0  # edge requests that met their session's detached run-ahead still decoding
    takeovers_full: int = 0  # ... full (the session sat out the forwards since; verifier.run_ahead_tokens)
    takeovers_stopped: int = 0  # ... stopped otherwise (finished, or trees pay again)


def tokens_per_server_cpu_s(w: Window) -> float:
    """The headline figure: verified tokens per CPU second of the whole server over the window."""
    return w.tokens_emitted / w.server_cpu_s if w.server_cpu_s > 0 else float("nan")


def pool_windows(windows: list[Window]) -> Window:
    """One window for the repeats of a configuration: every field is a total over its window (seconds,
    tokens, bytes, counts), so the pooled one is their sum and a pooled ratio weighs each repeat by
    its size."""
    return Window(**{f.name: sum(getattr(w, f.name) for w in windows) for f in fields(Window)})


def pool_roles(by_roles: list[dict]) -> dict:
    """CPU seconds by process role, summed over the repeats of a configuration."""
    out: dict = {}
    for roles in by_roles:
        for k, v in roles.items():
            out[k] = out.get(k, 0.0) + v
    return out


# where the server's CPU goes, per generated token (our modes): the target's forwards, the rest of the
# verifier replica, the router replica (server_sd: with its drafter), Serve's proxy, everything else.
# With topology colocated the router's work is in the verifier's replica: "verifier_other" holds both
# and "router" is 0
CPU_SPLIT = ("forward", "verifier_other", "router", "proxy", "background")


def verifier_role(by_role: dict) -> str:
    """The process role that holds our verifier: its own replica (``topology: split``), or the
    router's replica (``colocated``)."""
    return "verifier" if "verifier" in by_role else "router"


def cpu_split_ms_per_token(w: Window, by_role: dict, tokens: int) -> dict:
    """``cpu_ms_per_token_<part>`` for each part of :data:`CPU_SPLIT` (NaN where the server is not
    ours: no forward clock), and ``tokens_per_forward_cpu_s``: the tokens per CPU second of the
    target's forwards alone, i.e. the figure a request path and a background that cost nothing
    would give."""
    fwd = w.forward_cpu_s_prefill + w.forward_cpu_s_verify
    holder = verifier_role(by_role)
    if math.isnan(fwd) or tokens <= 0 or holder not in by_role:
        return {**{f"cpu_ms_per_token_{k}": float("nan") for k in CPU_SPLIT}, "tokens_per_forward_cpu_s": float("nan")}
    parts = {"forward": fwd, "verifier_other": by_role[holder] - fwd,
             "router": by_role.get("router", 0.0) if holder == "verifier" else 0.0,
             "proxy": by_role.get("proxy", 0.0)}
    parts["background"] = w.server_cpu_s - sum(parts.values())
    return {**{f"cpu_ms_per_token_{k}": 1e3 * v / tokens for k, v in parts.items()},
            "tokens_per_forward_cpu_s": tokens / fwd if fwd > 0 else float("nan")}


def row(mode: str, rtt_ms: float, sessions: int, w: Window, edge: dict, edges_priced: int,
        by_role: dict | None = None) -> dict:
    """One table row from the server window, the edge process's aggregate ``edge`` and the server's
    CPU seconds by process role over the window (``by_role``, :mod:`benchmarks.proc_stats`)."""
    busy = w.verifier_busy_s + w.server_draft_cpu_s
    gen = max(int(edge.get("tokens", 0)), 1)
    samples = [tuple(s) for s in edge.get("itl", [])]
    tps_wall = w.tokens_emitted / w.wall_s if w.wall_s > 0 else float("nan")

    def ms(x: float) -> float:
        return x * 1e3 if not math.isnan(x) else x

    return {
        "mode": mode, "rtt_ms": rtt_ms, "sessions": sessions,
        "generations": edge.get("generations", 0), "tokens": edge.get("tokens", 0),
        "server_tokens_per_busy_s": w.tokens_emitted / busy if busy > 0 else float("nan"),
        "server_tokens_per_s": tps_wall,
        "user_tokens_per_s": edge.get("user_tokens_per_s", float("nan")),
        "itl_ms_mean": ms(weighted_mean(samples)),
        "itl_ms_p50": ms(weighted_percentile(samples, 50)),
        "itl_ms_p99": ms(weighted_percentile(samples, 99)),
        "ttft_ms_mean": edge.get("ttft_ms_mean", float("nan")),
        "tokens_per_verify": edge.get("tokens_per_verify", float("nan")),
        "alignment_rate": edge.get("alignment_rate", float("nan")),
        "draft_depth_mean": edge.get("depth_mean", float("nan")),
        "draft_ms_per_forward": edge.get("draft_ms_mean", float("nan")),
        "draft_forwards_per_round": edge.get("draft_forwards_per_round", float("nan")),
        # server-side truncation: nodes sent vs nodes the replica chose to verify, per session round
        "sent_nodes_per_round": edge.get("sent_nodes_per_round", float("nan")),
        "verified_nodes_per_round": edge.get("verified_nodes_per_round", float("nan")),
        "server_tokens_per_cpu_s": (w.tokens_emitted / (w.verifier_cpu_s + w.server_draft_cpu_s)
                                    if w.verifier_cpu_s + w.server_draft_cpu_s > 0 else float("nan")),
        "tokens_per_server_cpu_s": tokens_per_server_cpu_s(w),
        "verifier_busy_s": w.verifier_busy_s, "server_draft_cpu_s": w.server_draft_cpu_s,
        "verifier_cpu_s": w.verifier_cpu_s, "server_cpu_s": w.server_cpu_s,
        "server_cpu_share": w.server_cpu_s / w.wall_s if w.wall_s > 0 else float("nan"),
        "verifier_utilisation": w.verifier_busy_s / w.wall_s if w.wall_s > 0 else float("nan"),
        "wall_s": w.wall_s,
        # batching: how many session rounds (and rows) one verify forward carried on average
        "sessions_per_forward": w.verify_sessions / w.verify_forwards if w.verify_forwards else float("nan"),
        "rows_per_forward": w.verify_rows / w.verify_forwards if w.verify_forwards else float("nan"),
        # what one verify forward costs its thread (CPU ms) and how many of them a token took: with
        # rows_per_forward, the row-cost curve as the live server met it (benchmarks.verify_step
        # measures the same curve alone), and the prefill forwards' share of a token's cost
        "verify_forward_cpu_ms": (1e3 * w.forward_cpu_s_verify / w.verify_forwards
                                  if w.verify_forwards else float("nan")),
        "verify_forwards_per_token": (w.verify_forwards / w.tokens_emitted
                                      if w.verify_forwards and w.tokens_emitted else float("nan")),
        "prefill_cpu_ms_per_token": (1e3 * w.forward_cpu_s_prefill / w.tokens_emitted
                                     if w.tokens_emitted else float("nan")),
        "prefill_tokens_per_generation": (w.prefill_tokens / gens if (gens := edge.get("generations"))
                                          else float("nan")),
        # detached run-ahead: the share of edge requests that found their session's run full (it had stopped
        # decoding before the request came: forwards it sat out)
        "run_ahead_full_share": (w.takeovers_full / takeovers if (takeovers := w.takeovers_running + w.takeovers_full
                                                                              + w.takeovers_stopped) else float("nan")),
        "uplink_bytes_per_token": w.up_bytes / gen, "downlink_bytes_per_token": w.down_bytes / gen,
        "uplink_payload_bytes_per_token": edge.get("up_payload_bytes", float("nan")) / gen,
        "downlink_payload_bytes_per_token": edge.get("down_payload_bytes", float("nan")) / gen,
        "cost_eff_ktok_per_usd": cost_efficiency_ktok_per_usd(tps_wall, edges_priced),
        "edges_priced": edges_priced,
        # issue 19: rounds whose next tree came from the pre-draft cache; mean exit layer of those hits
        "predraft_hit_rate": edge.get("predraft_hit_rate", float("nan")),
        "early_exit_layer_mean": edge.get("early_exit_layer_mean", float("nan")),
        "predraft_forwards_per_round": edge.get("predraft_forwards_per_round", float("nan")),
        **cpu_split_ms_per_token(w, by_role or {}, w.tokens_emitted),
    }


def _mean_of(gens: list[dict], key: str) -> float:
    xs = [x for g in gens for x in g.get(key, ())]
    return sum(xs) / len(xs) if xs else float("nan")


def aggregate(gens: list[dict], mode: str, wall_s: float, depth: int) -> dict:
    """A configuration's client figures from its generations (one dict per generation, as the
    edge process records them): tokens, ITL samples, acceptance and, for the edge modes
    (``edge_*``), drafting, alignment, truncation and payload bytes."""
    itl = [s for g in gens for s in itl_samples(g["arrivals"])]
    tokens = sum(g["tokens"] for g in gens)
    rounds = sum(g["rounds"] for g in gens)
    agg = {"generations": len(gens), "tokens": tokens, "wall_s": wall_s, "itl": itl,
           "user_tokens_per_s": sum(g["tokens"] / g["seconds"] for g in gens) / max(len(gens), 1),
           "ttft_ms_mean": 1e3 * sum(g["ttft_s"] for g in gens) / max(len(gens), 1),
           # the opening token comes with the prefill, not a verify round
           "tokens_per_verify": (tokens - len(gens)) / rounds if rounds else float("nan")}
    if mode.startswith("edge_"):  # benchmarks.edge_proc.EDGE_MODES
        att = sum(g["align_attempts"] for g in gens)
        agg.update(
            alignment_rate=sum(g["aligned"] for g in gens) / att if att else float("nan"),
            depth_mean=sum(g["depth_sum"] for g in gens) / rounds if rounds else float("nan"),
            draft_ms_mean=_mean_of(gens, "draft_ms"),
            draft_forwards_per_round=sum(g["draft_forwards"] for g in gens) / rounds if rounds else float("nan"),
            proactive_forwards=sum(g["proactive_forwards"] for g in gens),
            reopens=sum(g["reopens"] for g in gens),
            # 6 bytes per node, 7 with the confidence byte the replica's truncation uses
            up_payload_bytes=sum(20 * g["rounds"] + (6 + g["confidence"]) * g["draft_tokens"] for g in gens),
            verified_nodes_per_round=sum(g["verified_nodes"] for g in gens) / rounds if rounds else float("nan"),
            sent_nodes_per_round=sum(g["draft_tokens"] for g in gens) / rounds if rounds else float("nan"),
            down_payload_bytes=sum(24 * g["rounds"] + 2 * g["accepted"] for g in gens),
            rtt_ms_measured=_mean_of(gens, "rtt_ms"),
            round_ms_mean=_mean_of(gens, "round_ms"))  # send to reply, as the edge saw it
        hits = sum(g.get("predraft_hits", 0) for g in gens)
        early_hits = sum(g.get("predraft_early_hits", 0) for g in gens)
        if any(g.get("predraft_forwards") for g in gens):  # the pre-draft cache: guesses of the edge's own
            agg.update(predraft_hit_rate=hits / rounds if rounds else float("nan"),
                       predraft_forwards_per_round=(sum(g["predraft_forwards"] for g in gens) / rounds if rounds
                                                    else float("nan")))
        if any(g.get("early_frames") for g in gens):  # issue 19: and early results
            agg.update(early_exit_layer_mean=(sum(g["predraft_layer_sum"] for g in gens) / early_hits if early_hits
                                              else float("nan")),
                       early_frames_per_round=sum(g["early_frames"] for g in gens) / rounds if rounds else float("nan"))
    elif mode == "server_sd":
        agg.update(depth_mean=float(depth))
    return agg
