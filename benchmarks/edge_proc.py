"""The edge side of a benchmark: many edge agents (or thin server-only clients) in one process.

Started by :mod:`benchmarks.run` under ``taskset -c 1`` with ``torch.set_num_threads(1)``:
the whole edge population shares one core, as the verifier has the other. It reads one
JSON command per line on stdin and answers ``RESULT <json>`` on stdout:

- ``{"op": "init", "draft": ..., "tokenizer": bool}`` loads the draft once
  (``embedded-draft`` via :func:`edge_agent.embedded_draft.load_draft`, ``ngram``, or an
  ``load_model`` spec such as ``tiny-random`` with ``"seed"``).
- ``{"op": "run", "mode": ..., "url": ..., "sessions": S, "prompts": [[ids]...], ...}``
  runs ``S`` concurrent sessions as asyncio tasks, each working through its share of the
  prompts one generation after another, and answers their figures
  (:func:`benchmarks.metrics.aggregate`; with ``"gens": true`` the generations too).
  Edge modes: one :class:`edge_agent.agent.EdgeAgent` per session, each with its own draft
  KV cache. Their draft forwards share the one core
  (draft times are reported as measured): ``"edge_drafts": "shared"`` (the default) runs them
  on one :class:`edge_agent.draft_executor.DraftExecutor`, the trees sessions wait for before
  anyone's proactive work; ``"per-session"`` gives each agent its own draft thread, so up to
  ``S`` forwards time-slice the core.
  Server modes: a streaming ``/v1/completions`` client (``mode: ar|sd``), no draft.
  Peer modes (``vllm_ar``, ``vllm_ngram``): the same streaming client against vLLM's OpenAI
  server, with ``min_tokens`` = ``max_tokens`` and ``stream_options.continuous_usage_stats``
  (so every chunk says how many tokens it carries: exact per-step counts under vLLM's own
  speculation).

Everything is greedy with ``ignore_eos`` and a fixed ``max_tokens``, so every mode
generates the same number of tokens per prompt.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import traceback

import torch

from benchmarks.metrics import aggregate
from edge_agent.draft_executor import DraftExecutor

EDGE_MODES = {  # benchmark mode -> (agent mode, depth policy)
    "edge_stop_wait": ("stop-and-wait", "fixed"),
    "edge_proactive": ("proactive", "fixed"),
    # pipeline-aware: the verifier's pacing hint bounds the depth (SpecEdge §4.3), FlexSpec's
    # rule picks below it from measured acceptance and RTT (the agent's default policy, "auto")
    "edge_full": ("proactive", "auto"),
    # edge_full + early-exit pre-drafting (issue 19): early frames mid-forward, the pre-draft cache
    "edge_predraft": ("proactive", "auto"),
}
SERVER_MODES = {"server_ar": "ar", "server_sd": "sd"}
PEER_MODES = ("vllm_ar", "vllm_ngram")  # vLLM's OpenAI server; the speculation is the server's setting


class Edge:
    def __init__(self):
        self.draft_model = None
        self.draft_kind = None
        self.tokenizer = None
        self._drafts: DraftExecutor | None = None  # the configuration's shared draft executor

    def init(self, cmd: dict) -> dict:
        torch.set_num_threads(int(cmd.get("threads", 1)))
        kind = cmd["draft"]
        if cmd.get("tokenizer"):
            from specdec.model.loading import load_tokenizer

            self.tokenizer = load_tokenizer("embedded")
        if kind == "ngram":
            self.draft_model = None
        elif kind == "embedded-draft" or kind.endswith(".safetensors"):
            from edge_agent.embedded_draft import load_draft

            self.draft_model = load_draft(None, kind, dtype=cmd.get("dtype", "auto"))
        else:
            from specdec.model.loading import load_model

            self.draft_model = load_model(kind, dtype=cmd.get("dtype", "auto"), seed=int(cmd.get("seed", 0)),
                                          tiny_config=cmd.get("tiny_config")).model
        self.draft_kind = kind
        return {"draft": kind, "threads": torch.get_num_threads(), "affinity": sorted(os.sched_getaffinity(0))}

    def drafter(self):
        from edge_agent.draft_backends import ModelDrafter, NgramDrafter

        return NgramDrafter() if self.draft_model is None else ModelDrafter(self.draft_model, name=self.draft_kind)

    # -- edge agents ----------------------------------------------------------------------
    async def _edge_session(self, cmd: dict, prompts: list[list[int]], out: list):
        from edge_agent.agent import AgentConfig, EdgeAgent
        from edge_agent.transport import HttpTransport

        mode, policy = EDGE_MODES[cmd["mode"]]
        guesses = {}  # edge_full: the agent's default unless the plan sets it (AgentConfig.guesses)
        if cmd["mode"] == "edge_proactive":
            guesses = {"guesses": 0}  # SpecEdge §4.2 as published: one chain
        elif cmd.get("guesses") is not None:
            guesses = {"guesses": int(cmd["guesses"])}
        acfg = AgentConfig(mode=mode, depth_policy=policy, depth=int(cmd["depth"]),
                           max_depth=int(cmd.get("max_depth", 12)), budget=int(cmd.get("budget", 32)),
                           topk=int(cmd.get("topk", 4)), max_expand=int(cmd.get("max_expand", 8)),
                           check_tokenizer=self.tokenizer is not None, verify=cmd.get("verify") or "match",
                           model=cmd.get("version"),  # a target version (LoRA adapter); None: the base
                           predraft=cmd["mode"] == "edge_predraft", **guesses)
        async with HttpTransport(cmd["url"], api_key=cmd["api_key"], timeout_s=300.0) as tr:
            agent = EdgeAgent(tr, self.drafter(), self.tokenizer, acfg, draft_executor=self._drafts)
            try:
                for ids in prompts:
                    arrivals: list[tuple[float, int]] = []
                    t0 = time.perf_counter()
                    res = await agent.generate(ids, {"temperature": float(cmd.get("temperature", 0.0)),
                                                     "max_tokens": int(cmd["max_tokens"]),
                                                     "ignore_eos": True},
                                               on_tokens=lambda toks: arrivals.append((time.perf_counter(),
                                                                                       len(toks))))
                    s = res.stats
                    out.append({"tokens": s.tokens, "seconds": time.perf_counter() - t0, "ttft_s": s.ttft_s,
                                "arrivals": arrivals, "rounds": s.rounds, "draft_tokens": s.draft_tokens,
                                "verified_nodes": s.verified_nodes, "confidence": acfg.send_confidence,
                                "accepted": s.accepted_tokens, "aligned": s.aligned,
                                "align_attempts": s.align_attempts, "depth_sum": s.depth_sum,
                                "draft_forwards": s.draft_forwards, "proactive_forwards": s.proactive_forwards,
                                "draft_ms": s.draft_ms, "rtt_ms": s.rtt_ms, "round_ms": s.round_ms, "reopens": s.reopens,
                                "rejections": s.rejections, "refills": s.refills, "verify_rule": s.verify_rule,
                                "version": cmd.get("version"), "early_frames": s.early_frames,
                                "predraft_hits": s.predraft_hits, "predraft_misses": s.predraft_misses,
                                "predraft_forwards": s.predraft_forwards, "predraft_layer_sum": s.predraft_layer_sum,
                                "predraft_early_hits": s.predraft_early_hits})
            finally:
                agent.close()

    # -- server-only thin clients -----------------------------------------------------------
    async def _server_session(self, cmd: dict, prompts: list[list[int]], out: list):
        import httpx

        body_mode = SERVER_MODES[cmd["mode"]]
        headers = {"Authorization": f"Bearer {cmd['api_key']}"}
        async with httpx.AsyncClient(base_url=cmd["url"], headers=headers, timeout=300.0) as client:
            for ids in prompts:
                body = {"prompt": ids, "max_tokens": int(cmd["max_tokens"]),
                        "temperature": float(cmd.get("temperature", 0.0)),
                        "ignore_eos": True, "mode": body_mode, "stream": True}
                chunks: list[tuple[float, str]] = []
                t0 = time.perf_counter()
                async for d in _sse_events(client, body):
                    if d.get("choices"):
                        chunks.append((time.perf_counter(), d["choices"][0].get("text", "")))
                n = int(cmd["max_tokens"])  # ignore_eos: every generation is max_tokens long
                out.append(dict(self._server_counts(chunks, n, body_mode), seconds=time.perf_counter() - t0,
                                ttft_s=chunks[0][0] - t0 if chunks else float("nan")))

    # -- a peer's OpenAI server (vLLM) ------------------------------------------------------
    async def _openai_session(self, cmd: dict, prompts: list[list[int]], out: list):
        import httpx

        n = int(cmd["max_tokens"])
        async with httpx.AsyncClient(base_url=cmd["url"], timeout=300.0) as client:
            for ids in prompts:
                body = {"model": cmd["model"], "prompt": ids, "max_tokens": n, "min_tokens": n, "temperature": 0.0,
                        "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
                chunks: list[tuple[float, int | None, str]] = []
                t0 = time.perf_counter()
                async for d in _sse_events(client, body):
                    if d.get("choices"):  # not the closing usage-only chunk
                        used = (d.get("usage") or {}).get("completion_tokens")
                        chunks.append((time.perf_counter(), used, d["choices"][0].get("text", "")))
                c = openai_counts(chunks)
                if c["tokens"] != n:
                    raise RuntimeError(f"the peer generated {c['tokens']} tokens, not {n} (ignore_eos/min_tokens)")
                out.append(dict(c, seconds=time.perf_counter() - t0,
                                ttft_s=chunks[0][0] - t0 if chunks else float("nan")))

    def _server_counts(self, chunks: list[tuple[float, str]], n: int, mode: str) -> dict:
        """Tokens per SSE chunk. One chunk per verify round (the first is the opening token);
        AR rounds carry one token each; SD chunk sizes are estimated from the chunk text's
        token count, scaled so that they add up to the known total (exact totals, estimated split)."""
        if not chunks:
            return {"tokens": 0, "arrivals": [], "rounds": 0}
        rest = chunks[1:]
        if mode == "ar" or self.tokenizer is None:
            w = [1.0] * len(rest)
        else:
            w = [max(1.0, float(len(self.tokenizer.encode(t, add_special_tokens=False)))) for _, t in rest]
        scale = (n - 1) / sum(w) if w else 0.0
        arrivals = [(chunks[0][0], 1)] + [(t, wi * scale) for (t, _), wi in zip(rest, w)]
        rounds = (n - 1) if mode == "ar" else len(rest)
        return {"tokens": n, "arrivals": arrivals, "rounds": rounds}

    # -- one configuration ------------------------------------------------------------------
    async def run(self, cmd: dict) -> dict:
        prompts = cmd["prompts"]
        S = int(cmd["sessions"])
        shares = [prompts[i::S] for i in range(S)]
        out: list[dict] = []
        worker = (self._server_session if cmd["mode"] in SERVER_MODES else
                  self._openai_session if cmd["mode"] in PEER_MODES else self._edge_session)
        # target versions: session i asks for versions[i % len(versions)] (benchmarks/versions.py)
        versions = cmd.get("versions") or [cmd.get("version")]
        shared = cmd.get("edge_drafts", "shared") == "shared" and worker == self._edge_session
        self._drafts = DraftExecutor(name="edge-drafts") if shared else None
        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(worker({**cmd, "version": versions[i % len(versions)]}, share, out)
                                   for i, share in enumerate(shares) if share))
        finally:
            if self._drafts is not None:
                self._drafts.shutdown()
            self._drafts = None
        wall = time.perf_counter() - t0
        agg = aggregate(out, cmd["mode"], wall, int(cmd.get("depth", 0)))
        if len(versions) > 1:
            agg["by_version"] = {str(v): aggregate([g for g in out if g.get("version") == v], cmd["mode"], wall,
                                                   int(cmd.get("depth", 0))) for v in set(versions)}
        if cmd.get("gens"):  # the generations themselves: the caller pools repeats of a configuration
            agg["gens"] = out
        return agg


MAX_429_RETRIES = 8  # the openai client retries a 429 after its Retry-After (2 times by default)


async def _sse_events(client, body: dict):
    """POST a streaming ``/v1/completions`` request; yield each ``data:`` event's JSON object. A 429
    (an open past its first-token deadline) is retried after its Retry-After, as OpenAI's client
    does, and the wait counts in the request's time; an error event, or another non-200, raises."""
    for attempt in range(MAX_429_RETRIES + 1):
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code == 429 and attempt < MAX_429_RETRIES:
                await r.aread()
                await asyncio.sleep(float(r.headers.get("retry-after") or 1.0))
                continue
            if r.status_code != 200:
                raise RuntimeError(f"/v1/completions -> {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    raise RuntimeError(f"stream error: {d['error']}")
                yield d
            return


def openai_counts(chunks: list[tuple[float, int | None, str]]) -> dict:
    """Tokens per streamed chunk from the cumulative ``usage.completion_tokens`` each chunk
    carries (continuous usage stats); a chunk without usage counts one token. One chunk is one
    engine step of that request (the first brings the prefill's token), so ``rounds`` = chunks
    after the first that carried tokens."""
    arrivals, seen = [], 0
    for t, used, _ in chunks:
        n = (used - seen) if used is not None else 1
        seen = used if used is not None else seen + 1
        if n > 0 or not arrivals:
            arrivals.append((t, n))
    return {"tokens": seen, "arrivals": arrivals, "rounds": max(0, len(arrivals) - 1)}


def main() -> None:
    edge = Edge()
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        try:
            if cmd["op"] == "init":
                res = edge.init(cmd)
            elif cmd["op"] == "run":
                res = asyncio.run(edge.run(cmd))
            elif cmd["op"] == "exit":
                break
            else:
                raise ValueError(f"unknown op {cmd['op']!r}")
            print("RESULT " + json.dumps({"ok": True, **res}), flush=True)
        except Exception as e:  # noqa: BLE001 - reported to the orchestrator, which fails the run
            print("RESULT " + json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}",
                                          "traceback": traceback.format_exc()}), flush=True)


if __name__ == "__main__":
    main()
