"""A benchmark run's report: its rows pooled over repeats, the tables, the files it writes.

:func:`config_row` pools a configuration's repeats into one row; :func:`markdown_table`,
:func:`headline_table` (whole-server cost first), :func:`targets_table` (issue 15's targets, met
or missed) and :func:`cpu_split_table` render rows; :func:`write_results` writes
``<run>.json``/``.parquet``/``.md``/plots (and ``latest.json``); :func:`render_readme` rewrites
the results log's generated section (from ``README_MARK`` to the next level-2 heading).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

from benchmarks.run_plan import EDGE_CORE, EDGE_DRAFTS, PEER_MODES, RESULTS, SERVER_CORE, Plan, draft_meta


LATEST_KEYS = ("mode", "rtt_ms", "sessions", "server_tokens_per_busy_s", "tokens_per_server_cpu_s",
               "server_tokens_per_s", "itl_ms_mean",
               "itl_ms_p99", "tokens_per_verify", "alignment_rate", "uplink_bytes_per_token",
               "downlink_bytes_per_token")


def config_row(mode: str, rule: str | None, rtt: float, sessions: int, got: list[tuple[dict, dict]], depth: int,
               temperature: float) -> dict:
    """One table row from the repeats ``got`` of a configuration (the edge's figures with its
    generations, the server's window and CPU by role, for each): the windows and generations
    pooled, so a pooled figure is a total over a total; and the whole-server figure of each repeat
    (``repeat_tokens_per_server_cpu_s``)."""
    from benchmarks.metrics import Window, aggregate, pool_roles, pool_windows, row, tokens_per_server_cpu_s

    windows = [Window(**extra["window"]) for _, extra in got]
    w = pool_windows(windows)
    res = aggregate([g for r, _ in got for g in r["gens"]], mode, sum(r["wall_s"] for r, _ in got), depth)
    r = row(mode, rtt, sessions, w, res, edges_priced=sessions if mode.startswith("edge") else 0,
            by_role=pool_roles([extra.get("server_cpu", {}).get("by_role", {}) for _, extra in got]))
    # server_sd at T > 0 runs the server's sampled_rule (tree-rejection by default)
    r["verify"] = rule or ("tree-rejection" if mode == "server_sd" and temperature > 0 else
                           "match" if mode == "server_sd" else "-")
    r["temperature"] = temperature
    r["repeats"] = len(got)
    r["repeat_tokens_per_server_cpu_s"] = [tokens_per_server_cpu_s(one) for one in windows]
    return r


def fmt(x, nd=1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def run_conditions(plan: Plan, *, run_id: str, name: str, complete: bool, draft: str, depth: int, calib: dict | None,
                   prompt_names: list[str], request_path, peer_status: dict, vllm_info: dict, load_samples: list,
                   t_start: float, rows: list[dict], background_bursts: dict | None = None) -> dict:
    """The ``conditions`` of a run's JSON: what ran where, how cost was counted, the headline ratios."""
    from benchmarks.peers import NGRAM_SPEC, vllm_version
    from edge_agent.agent import AgentConfig

    draft_note = {"embedded-draft": "the project's trained draft (edge_agent/artifacts/embedded-draft)",
                  "ngram": "n-gram prompt lookup (no trained draft artifact was available)"}.get(draft, draft)
    conditions = {
        "run": run_id, "plan": name, "complete": complete, "target": plan.target + (" (SmolLM2-135M-Instruct, bf16)"
                                                              if plan.target == "embedded" else ""),
        "draft": draft, "draft_note": draft_note, "draft_meta": draft_meta(draft),
        "server_side_drafter": "prompt lookup (chain)" if draft == "ngram" else f"{draft} tree drafter on core 0",
        "fixed_depth": depth, "depth_calibration": calib, "tree_budget": plan.budget, "topk": plan.topk,
        "edge_full_guesses": AgentConfig().guesses if plan.guesses is None else plan.guesses,  # edge_proactive: 0
        "rtt_sweep_ms": plan.rtts, "rtt_sweep_sessions": plan.rtt_sessions, "sessions_sweep": plan.sessions,
        "sessions_sweep_rtt_ms": plan.sessions_rtt, "bandwidth_mbps": plan.mbps or "unlimited",
        "prompts_per_config": f"{plan.prompts}, at least {plan.generations_per_session} per session, rounded up "
                              "to a multiple of the sessions, alternating MT-Bench turn 1 / HumanEval (the first "
                              "ones of each set)",
        "repeats": (f"{plan.repeats}: each configuration's modes {plan.repeats} times, as listed then reversed, "
                    "pooled into one row (tokens and CPU seconds summed); repeat_tokens_per_server_cpu_s holds "
                    "each repeat's figure" if plan.repeats > 1 else 1),
        "prompt_ids": prompt_names, "max_tokens": plan.max_tokens, "app_overrides": plan.app_set,
        "batch_cap": f"{plan.batch_cap()} sessions per forward, ours (verifier.max_batch_sessions) and vLLM's "
                     "(--max-num-seqs)",
        "sampling": (f"temperature {plan.temperature}, seeded, ignore_eos; edge rules {plan.verify}"
                     if plan.temperature > 0 else "greedy, ignore_eos"),
        "cores": f"server on core {SERVER_CORE} (taskset: every Ray/Serve process, verifier with 1 torch thread; "
                 f"the vLLM peer likewise, 1 OpenMP thread, after our server stopped); edge agents on core "
                 f"{EDGE_CORE} (taskset, 1 torch thread, one asyncio task per session; draft forwards: "
                 f"{EDGE_DRAFTS[plan.edge_drafts]}); "
                 "WAN proxy unpinned",
        "request_path": request_path.model_dump(mode="json", exclude={"direct_port"}),
        "prefix_caching": "off in ours (verifier.prefix_caching: false) and in vLLM (--no-enable-prefix-caching): "
                          "prompts repeat across the run's configurations and modes",
        "server_cost": "verifier busy seconds (+ server-side drafter thread CPU seconds for server_sd)",
        "whole_server_cost": f"utime+stime (/proc) of every process of the server's process tree (all on core "
                             f"{SERVER_CORE}), reaped children included, over each configuration's window: Serve "
                             "proxy, router and verifier replicas, Serve controller, raylet, GCS, Ray agents, the "
                             "driver; vLLM: API server, engine core, worker",
        "engine_cost": "CPU seconds of the verifier replica process (+ the server-side drafter thread for "
                       "server_sd); vLLM: engine core + worker processes",
        "peers": peer_status,
        "vllm": ({"version": vllm_version(), "servers": vllm_info, "ngram": NGRAM_SPEC,
                  "summary": f"{vllm_version()} OpenAI server, bf16, 1 OpenMP thread on core {SERVER_CORE} "
                             f"(taskset), prefix caching off; vllm_ngram: {json.dumps(NGRAM_SPEC)}"}
                 if vllm_info else None),
        "itl": "a batch of n tokens after a gap g counts n samples of g/n; server modes: SSE chunk per round",
        "bytes": "TCP payload through the WAN proxy (HTTP headers included), per generated token",
        "prices_usd_per_h": {"server (A100 40GB)": 4.05, "edge (RTX 4090), per edge session": 0.35},
        "machine": {"cpus": os.cpu_count(), "loadavg_1m_samples": {
            "min": min(load_samples, default=0), "mean": sum(load_samples) / max(len(load_samples), 1),
            "max": max(load_samples, default=0)}},
        "background_bursts": background_bursts,  # our server's other processes' (benchmarks/bursts.py)
        "wall_minutes": (time.time() - t_start) / 60,
        "headline": {f"rtt{int(r)}_s{s}": ratios(rows, r, s) for r, s in plan.configs()},
    }
    return conditions

TABLE_COLS = [("mode", "mode", 0), ("rtt_ms", "RTT ms", 0), ("sessions", "sess", 0),
              ("tokens_per_server_cpu_s", "tok/srv-cpu-s", 1), ("server_tokens_per_busy_s", "tok/busy-s", 1),
              ("server_tokens_per_cpu_s", "tok/eng-cpu-s", 1), ("server_tokens_per_s", "tok/wall-s", 1),
              ("server_cpu_share", "srv core", 2),
              ("itl_ms_mean", "ITL mean", 1), ("itl_ms_p50", "ITL p50", 1), ("itl_ms_p99", "ITL p99", 1),
              ("tokens_per_verify", "tok/verify", 2), ("verified_nodes_per_round", "nodes verified", 1),
              ("alignment_rate", "align", 2),
              ("draft_depth_mean", "depth", 1), ("draft_ms_per_forward", "draft ms/fwd", 1),
              ("verifier_utilisation", "util", 2), ("sessions_per_forward", "sess/fwd", 1),
              ("run_ahead_full_share", "ahead full", 2), ("rows_per_forward", "rows/fwd", 0),
              ("verify_forward_cpu_ms", "ms/fwd", 1), ("verify_forwards_per_token", "fwd/tok", 2),
              ("uplink_bytes_per_token", "up B/tok", 0), ("downlink_bytes_per_token", "down B/tok", 0),
              ("cost_eff_ktok_per_usd", "ktok/$", 1)]


# the verification rule and temperature of a row (issue 17): shown after the mode whenever they tell
# rows apart or differ from the defaults (greedy, sample-then-match); "-" (server_ar, peers) says nothing
RULE_COLS = [("verify", "verify", 0, "match"), ("temperature", "T", 1, 0.0)]


def _table_cols(rows: list[dict]) -> list[tuple[str, str, int]]:
    extra = []
    for k, h, nd, default in RULE_COLS:
        seen = {r[k] for r in rows if r.get(k) not in (None, "-")}
        if len(seen) > 1 or seen - {default}:
            extra.append((k, h, nd))
    return TABLE_COLS[:1] + extra + TABLE_COLS[1:]


def markdown_table(rows: list[dict]) -> str:
    cols = _table_cols(rows)
    head = "| " + " | ".join(h for _, h, _ in cols) + " |"
    sep = "|" + "|".join("---" for _ in cols) + "|"
    body = ["| " + " | ".join(fmt(r.get(k), nd) for k, _, nd in cols) + " |" for r in rows]
    return "\n".join([head, sep] + body)


def _ratio(a, b) -> float:
    try:
        return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")
    except TypeError:
        return float("nan")


RATIO_KEYS = ("tokens_per_server_cpu_s", "server_tokens_per_busy_s", "server_tokens_per_cpu_s", "server_tokens_per_s")


def ratios(rows: list[dict], rtt: float, sessions: int) -> dict:
    """Headline ratios at one (RTT, sessions) point: edge_full vs the server-only baselines and
    the vLLM peer rows present."""
    at = {r["mode"]: r for r in rows if r["rtt_ms"] == rtt and r["sessions"] == sessions}
    out = {}
    full = at.get("edge_full")
    for base in ("server_ar", "server_sd") + PEER_MODES:
        b = at.get(base)
        if full and b:
            out[f"edge_full_vs_{base}"] = {
                **{k: _ratio(full.get(k, float("nan")), b.get(k, float("nan"))) for k in RATIO_KEYS},
                "itl_ms_mean_change": _ratio(full["itl_ms_mean"], b["itl_ms_mean"]) - 1.0,
                "itl_ms_p50_ratio": _ratio(full.get("itl_ms_p50", float("nan")), b.get("itl_ms_p50", float("nan"))),
                "cost_eff": _ratio(full["cost_eff_ktok_per_usd"], b["cost_eff_ktok_per_usd"])}
    return out


def write_results(run_id: str, conditions: dict, rows: list[dict], extras: list[dict], out_dir: Path,
                  latest: bool) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from benchmarks.plots import plot_all

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    doc = {"conditions": conditions, "rows": rows, "details": extras}
    paths["json"] = out_dir / f"{run_id}.json"
    paths["json"].write_text(json.dumps(doc, indent=1, default=float))
    paths["parquet"] = out_dir / f"{run_id}.parquet"
    pq.write_table(pa.Table.from_pylist(rows), paths["parquet"])
    paths["md"] = out_dir / f"{run_id}.md"
    paths["md"].write_text(f"# Benchmark {run_id}\n\n```json\n{json.dumps(conditions, indent=1)}\n```\n\n"
                           + markdown_table(rows) + "\n")
    paths.update(plot_all(rows, out_dir, run_id))
    if latest:
        slim = [{k: r[k] for k in r} for r in rows]
        paths["latest"] = out_dir / "latest.json"
        paths["latest"].write_text(json.dumps({"conditions": conditions, "rows": slim}, indent=1) + "\n")
    return paths


README_MARK = "## Latest full run"


HEADLINE_MODES = ("server_ar", "server_sd", "edge_full") + PEER_MODES


def _short_target(c: dict) -> str:
    t = c.get("target", "")
    return "SmolLM2-135M-Instruct, bf16" if t.startswith("embedded") else t


def repeat_ratios(a: dict, b: dict, key: str = "tokens_per_server_cpu_s") -> list[float]:
    """``a``'s figure over ``b``'s, repeat by repeat ([] where either row was measured once)."""
    ra, rb = a.get(f"repeat_{key}") or [], b.get(f"repeat_{key}") or []
    return [_ratio(x, y) for x, y in zip(ra, rb)] if len(ra) == len(rb) > 1 else []


def ratio_cell(a: dict, b: dict) -> str:
    """``a`` / ``b`` in tokens per whole-server CPU-second, with its range over the repeats."""
    r = _ratio(a.get("tokens_per_server_cpu_s", float("nan")), b.get("tokens_per_server_cpu_s", float("nan")))
    if math.isnan(r):
        return "-"
    each = [x for x in repeat_ratios(a, b) if not math.isnan(x)]
    return f"x{r:.2f}" + (f" ({min(each):.2f}-{max(each):.2f})" if each else "")


def headline_table(doc: dict) -> list[str]:
    """The headline: tokens per whole-server CPU-second for each (RTT, sessions) point, with the
    conditions of every figure; edge_full's ratios to the baselines beside them."""
    c, rows = doc["conditions"], doc["rows"]
    points = list(dict.fromkeys((r["rtt_ms"], r["sessions"]) for r in rows))
    modes = [m for m in HEADLINE_MODES if any(r["mode"] == m for r in rows)]
    if not any(isinstance(r.get("tokens_per_server_cpu_s"), (int, float))
               and not math.isnan(r["tokens_per_server_cpu_s"]) for r in rows):
        return ["This run predates whole-server CPU accounting (no `tok/srv-cpu-s`); see the full table.", ""]
    bases = [m for m in ("vllm_ar", "server_ar", "server_sd") if m in modes] if "edge_full" in modes else []
    cond = (f"{_short_target(c)}; server: every process on core {SERVER_CORE} (`taskset`, 1 thread); edges on "
            f"core {EDGE_CORE}; {c['max_tokens']} tokens per prompt, {c.get('sampling', 'greedy')}")
    itl = "edge_full" in modes and "vllm_ar" in modes  # the ITL target is stated against vllm_ar
    head = (["RTT ms", "sessions"] + [f"`{m}`" for m in modes] + [f"`edge_full` / `{b}`" for b in bases]
            + (["ITL p50 ms `edge_full` / `vllm_ar`"] if itl else []) + ["conditions"])
    out = ["### Headline: tokens per whole-server CPU-second", "",
           "Verified tokens per CPU second of *all* server processes (Serve proxy, router, verifier, controller, "
           "Ray's raylet/GCS/agents; vLLM's API server, engine core and worker), from /proc over each "
           "configuration's window. Conditions in every row. Where a run repeats each configuration, a ratio "
           "is the pooled rows' and the brackets give its lowest and highest over the repeats (repeat i of "
           "one mode against repeat i of the other).", "",
           "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for rtt, ses in points:
        at = {r["mode"]: r for r in rows if r["rtt_ms"] == rtt and r["sessions"] == ses}
        cells = [fmt(rtt, 0), str(ses)] + [fmt(at.get(m, {}).get("tokens_per_server_cpu_s"), 1) for m in modes]
        full = at.get("edge_full", {})
        for b in bases:
            cells.append(ratio_cell(full, at.get(b, {})))
        if itl:
            cells.append(f"{fmt(full.get('itl_ms_p50'), 1)} / {fmt(at.get('vllm_ar', {}).get('itl_ms_p50'), 1)}")
        cells.append(f"{cond}; {ses} session(s), RTT {fmt(rtt, 0)} ms")
        out.append("| " + " | ".join(cells) + " |")
    peers = c.get("peers") or {}
    skipped = {m: v for m, v in peers.items() if str(v).startswith("skipped")}
    if skipped:
        out += ["", "vLLM rows: " + "; ".join(f"`{m}` {v}" for m, v in skipped.items()) + "."]
    return out + [""]


# issue 15's targets, at RTT 15 ms: edge_full's tokens per whole-server CPU-second over a baseline's,
# at least `floor`, at each number of sessions listed (None: at every point the run measured)
ISSUE_15_RTT_MS = 15


ISSUE_15_RATIOS = (("vllm_ar", 1.5, (1,)), ("vllm_ar", 1.2, (4,)), ("vllm_ar", 1.0, (16,)),
                   ("server_sd", 2.0, None), ("server_ar", 1.0, None))


ISSUE_15_ITL = 1.1  # edge_full's ITL p50 at 1 session, at most this times vllm_ar's


# the sweep's verified nodes may rise by this much from one load to the next and still count as falling:
# at budget 0 a rare round still carries a tree (0.00 -> 0.01 nodes a round in run 20261125-131026-full)
ISSUE_15_NODES_SLACK = 0.05


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else "met" if ok else "**missed**"


def targets_table(doc: dict) -> list[str]:
    """Issue 15's targets against this run, each with its figure and a verdict: met, missed, or not
    measured (the run lacks the point or the mode). A ratio counts as met only where its pooled
    figure reaches the floor; its range over the repeats is shown beside it, so a tie within noise
    reads as one."""
    rows = [r for r in doc["rows"] if r["rtt_ms"] == ISSUE_15_RTT_MS]
    at = {(r["mode"], r["sessions"]): r for r in rows}
    swept = sorted({r["sessions"] for r in rows})
    out = ["### Issue 15's targets (RTT 15 ms)", "", "| target | sessions | measured | verdict |", "|---|---|---|---|"]
    key = "tokens_per_server_cpu_s"  # absent from a run before whole-server accounting: not measured
    for base, floor, where in ISSUE_15_RATIOS:
        for ses in where or swept:
            full, b = at.get(("edge_full", ses), {}), at.get((base, ses), {})
            r = _ratio(full.get(key, float("nan")), b.get(key, float("nan")))
            out.append(f"| `edge_full` / `{base}` >= x{floor:.1f} | {ses} | {ratio_cell(full, b)} | "
                       f"{_verdict(None if math.isnan(r) else r >= floor)} |")
    full, peer = at.get(("edge_full", 1)), at.get(("vllm_ar", 1))
    itl = _ratio(full.get("itl_ms_p50", float("nan")), peer.get("itl_ms_p50", float("nan"))) if full and peer else float("nan")
    out.append(f"| ITL p50 `edge_full` / `vllm_ar` <= x{ISSUE_15_ITL} | 1 | {'-' if math.isnan(itl) else f'x{itl:.2f}'} | "
               f"{_verdict(None if math.isnan(itl) else itl <= ISSUE_15_ITL)} |")
    nodes = [(ses, at[("edge_full", ses)].get("verified_nodes_per_round", float("nan")))
             for ses in swept if ("edge_full", ses) in at]
    nodes = [(ses, v) for ses, v in nodes if not math.isnan(v)]
    falling = (all(b <= a + ISSUE_15_NODES_SLACK for (_, a), (_, b) in zip(nodes, nodes[1:]))
               if len(nodes) > 1 else None)
    out.append(f"| verified nodes per session round fall as load rises (each <= the last + {ISSUE_15_NODES_SLACK}) | "
               + ", ".join(str(ses) for ses, _ in nodes) + " | " + (", ".join(f"{v:.2f}" for _, v in nodes) or "-")
               + f" | {_verdict(falling)} |")
    return out + [""]


SPLIT_MODES = ("server_ar", "edge_full")


def cpu_split_table(doc: dict) -> list[str]:
    """Where our server's CPU goes per generated token (``benchmarks.metrics.cpu_split_ms_per_token``),
    next to vLLM's whole server, and what the target's forwards alone would give against vLLM."""
    from benchmarks.metrics import CPU_SPLIT

    rows = doc["rows"]
    if not any(not math.isnan(r.get("tokens_per_forward_cpu_s", float("nan"))) for r in rows):
        return []
    head = ["RTT ms", "sessions", "mode", "forwards", "verifier other", "router", "proxy", "Ray/Serve rest",
            "whole server", "`vllm_ar` whole server", "tok/fwd-cpu-s", "tok/fwd-cpu-s / `vllm_ar` tok/srv-cpu-s"]
    out = ["### Where the server's CPU goes", "",
           "Server CPU milliseconds per generated token: the target's forwards (the forward thread's own CPU "
           "time, prefill and verify; `busy_cpu_seconds` of `GET /v1/stats`), the rest of the verifier replica "
           "(Serve's request handling, the batch loop, tree walks, replies), the router replica, Serve's "
           "proxy, and every other server process (controller, raylet, GCS, agents, driver). With "
           "`topology: colocated` (the benchmark's default) the router's work is in the verifier's replica: "
           "\"verifier other\" holds it and \"router\" is 0. "
           "`tok/fwd-cpu-s`: tokens per CPU second of the forwards alone, i.e. what a request path and a "
           "background that cost nothing would give; against `vllm_ar`'s whole server it says whether the "
           "engine or the request path bounds a target.", "",
           "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for rtt, ses in dict.fromkeys((r["rtt_ms"], r["sessions"]) for r in rows):
        at = {r["mode"]: r for r in rows if r["rtt_ms"] == rtt and r["sessions"] == ses}
        vllm = at.get("vllm_ar", {}).get("tokens_per_server_cpu_s", float("nan"))
        vllm_ms = 1e3 / vllm if vllm and not math.isnan(vllm) else float("nan")
        for m in SPLIT_MODES:
            r = at.get(m)
            if r is None or math.isnan(r.get("tokens_per_forward_cpu_s", float("nan"))):
                continue
            parts = [r[f"cpu_ms_per_token_{k}"] for k in CPU_SPLIT]
            bound = _ratio(r["tokens_per_forward_cpu_s"], vllm)
            out.append("| " + " | ".join([fmt(rtt, 0), str(ses), f"`{m}`"] + [fmt(v, 2) for v in parts]
                                         + [fmt(sum(parts), 2), fmt(vllm_ms, 2), fmt(r["tokens_per_forward_cpu_s"], 1),
                                            "-" if math.isnan(bound) else f"x{bound:.2f}"]) + " |")
    return out + [""]


def readme_section(doc: dict) -> str:
    """The README's table of a run: its conditions, the headline (whole-server cost), the full
    table, and the headline ratios."""
    c = doc["conditions"]
    noise = c.get("machine", {}).get("loadavg_1m_samples", {})
    lines = [README_MARK, "",
             f"Run `{c['run']}` ({c['wall_minutes']:.0f} min): target {c['target']}; draft: {c['draft_note']}; "
             f"server-side drafter of `server_sd`: {c['server_side_drafter']}; fixed depth {c['fixed_depth']} "
             f"(calibrated: best tokens per server second, stop-and-wait, over {list((c.get('depth_calibration') or {}).get('by_depth', {}))}); "
             f"tree budget {c['tree_budget']} nodes, top-{c['topk']}; {c['max_tokens']} new tokens per prompt "
             f"({c['sampling']}); prompts per configuration: {c['prompts_per_config']}; RTT sweep "
             f"{c['rtt_sweep_ms']} ms at {c['rtt_sweep_sessions']} sessions, sessions sweep {c['sessions_sweep']} "
             f"at {c['sessions_sweep_rtt_ms']} ms; bandwidth {c['bandwidth_mbps']}. Cores: {c['cores']}. "
             + (f"vLLM peer: {c['vllm']['summary']}. " if c.get("vllm") else "")
             + f"Machine load (1-min load average on 2 cores): min {noise.get('min', 0):.0f}, "
             f"mean {noise.get('mean', 0):.0f}, max {noise.get('max', 0):.0f}.", ""]
    lines += headline_table(doc)
    lines += targets_table(doc)
    lines += cpu_split_table(doc)
    lines += ["### All figures", "", markdown_table(doc["rows"]), ""]
    target = _short_target(c)

    def x(v) -> str:
        return "-" if v is None or math.isnan(v) else f"x{v:.2f}"

    for rtt, ses in dict.fromkeys((r["rtt_ms"], r["sessions"]) for r in doc["rows"]):
        for name, r in ratios(doc["rows"], rtt, ses).items():
            itl = r["itl_ms_mean_change"]
            lines.append(f"- RTT {fmt(rtt, 0)} ms, {ses} session(s) ({target}, server on 1 core) {name}: "
                         f"tokens/whole-server-cpu-s {x(r.get('tokens_per_server_cpu_s'))}, "
                         f"tokens/busy-s {x(r['server_tokens_per_busy_s'])}, "
                         f"tokens/engine-cpu-s {x(r.get('server_tokens_per_cpu_s'))}, "
                         f"tokens/wall-s {x(r['server_tokens_per_s'])}, "
                         f"ITL {'-' if math.isnan(itl) else f'{100 * itl:+.0f}%'}, cost efficiency {x(r['cost_eff'])}")
    return "\n".join(lines) + "\n"


def render_readme(results_json: Path, readme: Path = RESULTS / "README.md") -> None:
    """Replace the generated section (from ``README_MARK`` to the next level-2 heading) with this
    run's; every hand-written section before and after it (other issues' figures, the discussion)
    is kept whole."""
    head, mark, rest = readme.read_text().partition(README_MARK)
    after = re.search(r"^## ", rest, re.M) if mark else None
    tail = "\n" + rest[after.start():] if after else ""
    readme.write_text(head.rstrip() + "\n\n" + readme_section(json.loads(results_json.read_text())) + tail)
