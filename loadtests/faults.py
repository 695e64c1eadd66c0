"""A worker node lost and the head's GCS restarted under live edge sessions, on a multi-node cluster on one
machine (loadtests/cluster.py), with every output checked against the target's own greedy decoding.

    python -m loadtests.faults --scenarios node-loss,gcs-restart --out .cache/faults/result.json

One process: Redis, a head (this process is its driver) and two worker nodes, the app with its verifier replicas
spread one per node (``verifier.max_replicas_per_node: 1``) and two router replicas, then each scenario in turn
on the same cluster. Edges (:class:`Edge`, asyncio + httpx, the HTTP session protocol) loop over generations of a
small prompt pool from a tiny random target, drafting from the known greedy continuation with noise, as the
tests' oracle edge; a session whose replica went away (404/410, 503, a proxy's 5xx, a dropped connection) is
re-opened from the edge's own history, as the edge agent does. What a scenario returns (JSON, checked by
tests/loadtests/test_cluster_faults.py):

- ``node-loss``: a worker node holding a verifier replica SIGKILLed (raylet, workers, agents) while the edges
  decode; its sessions re-open on the surviving replicas; later a new worker node joins and Serve places the
  missing replica there (3 replicas on 3 nodes again);
- ``gcs-restart``: the head's ``gcs_server`` SIGKILLed while the edges decode, restarted ``--gcs-down-s`` later
  on the same port, loading the cluster's tables from Redis; requests counted before, during and after the
  outage; afterwards the same nodes, Serve controller and replicas are alive, and a replica killed then is
  replaced (the restarted GCS creates actors again).

Per scenario: generations started / finished / matching the reference (every output equal to the undisturbed
greedy decoding of its prompt: the same prompts are decoded before the fault too), requests by outcome (ok,
retried: 429/503/replica gone/connection; errors: anything else), re-opens, sessions still held by the verifiers
after every edge closed its own (0: nothing duplicated, nothing leaked), tokens per second around the fault.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

APP = "specedge"
KEY = "specedge-dev-key"  # the app's development tenant (no tenants configured)
TINY = {"model": "tiny-random", "dtype": "float32", "seed": 0}
SCENARIOS = ("node-loss", "gcs-restart")
# A session whose open reached a verifier but whose reply was lost with its router (a node's loss takes router
# replicas too) is held by no edge: the verifier's idle sweep frees it after this long (600 s by default)
IDLE_TIMEOUT_S = 10.0


def app_args(verifiers: int = 3, routers: int = 2) -> dict:
    return {"target": dict(TINY),
            "verifier": {"num_replicas": verifiers, "max_replicas_per_node": 1, "num_cpus": 0.5, "torch_threads": 1,
                         "batch_wait_ms": 2.0, "warmup": False, "idle_timeout_s": IDLE_TIMEOUT_S},
            "router": {"num_replicas": routers}, "server_draft": {"enabled": False}, "access_log": False}


# ------------------------------------------------------------------------------------------ the edges
@dataclass
class Tally:
    """What every edge saw, merged: requests by outcome and when, generations and their outputs."""

    ok: int = 0
    retried: dict[str, int] = field(default_factory=dict)  # outcome -> count (handled by a retry or a re-open)
    errors: dict[str, int] = field(default_factory=dict)  # anything else (the generation is abandoned)
    reopens: int = 0
    lost_open_replies: int = 0  # opens answered by a proxy's 5xx or a dropped connection: maybe opened, unknown
    opens: int = 0
    closes: int = 0
    generations: int = 0
    finished: int = 0
    mismatched: int = 0  # finished outputs not equal to the reference
    requests: list[tuple[float, str]] = field(default_factory=list)  # (epoch s, "ok" | "retried:.." | "error:..")
    tokens: list[tuple[float, int]] = field(default_factory=list)  # (epoch s, tokens verified)
    outputs: dict[int, list[list[int]]] = field(default_factory=dict)  # prompt index -> outputs
    live: dict[int, tuple[str, int]] = field(default_factory=dict)  # edge -> (its open session, tokens it has)

    def request(self, outcome: str) -> None:
        self.requests.append((time.time(), outcome))
        if outcome == "ok":
            self.ok += 1
        elif outcome.startswith("retried:"):
            k = outcome[8:]
            self.retried[k] = self.retried.get(k, 0) + 1
        else:
            k = outcome[6:]
            self.errors[k] = self.errors.get(k, 0) + 1


def oracle_tree(truth: list[int], rng: random.Random, vocab: int, max_nodes: int = 24):
    """A draft tree whose main chain follows ``truth`` for a random length (typos included) plus side branches
    (also the serving tests' oracle edge's, tests/router/oracle_edge.py)."""
    tokens, parents, parent = [], [], -1
    for t in truth[: rng.randint(0, 8)]:
        tokens.append(t if rng.random() < 0.85 else rng.randrange(vocab))
        parents.append(parent)
        parent = len(tokens) - 1
    while len(tokens) < min(max_nodes, len(tokens) + rng.randint(1, 6)):
        tokens.append(rng.randrange(vocab))
        parents.append(rng.randint(-1, len(tokens) - 2))
    return tokens, parents


def _is_app_error(r) -> bool:
    try:
        body = r.json()
    except ValueError:
        return False
    return isinstance(body, dict) and isinstance(body.get("error"), dict) and "code" in body["error"]


class Edge:
    """One edge: generations back to back until ``stop`` is set; every request's outcome in ``tally``."""

    def __init__(self, client, prompts: list[list[int]], truths: list[list[int]], vocab: int, tally: Tally,
                 seed: int, max_tokens: int, rtt_s: float = 0.02, give_up_s: float = 120.0):
        self.client, self.prompts, self.truths, self.vocab, self.t = client, prompts, truths, vocab, tally
        self.rng = random.Random(seed)
        self.max_tokens, self.rtt_s, self.give_up_s = max_tokens, rtt_s, give_up_s
        self.headers = {"Authorization": f"Bearer {KEY}"}
        self.seed, self.next_prompt = seed, seed % len(prompts)
        self.retry_after = 0.25

    async def _send(self, method: str, path: str, **kw) -> tuple[str, object]:
        """One request: ("ok", response) | ("retry", why) | ("gone", why) | ("error", why)."""
        try:
            r = await self.client.request(method, path, headers=self.headers, **kw)
        except Exception as e:  # noqa: BLE001 (a connection reset or refused: a proxy or router gone)
            self.t.request(f"retried:{type(e).__name__}")
            return "retry", type(e).__name__
        if r.status_code == 200:
            self.t.request("ok")
            return "ok", r
        if r.status_code in (404, 410):
            self.t.request(f"retried:{r.status_code}")
            return "gone", str(r.status_code)
        if r.status_code in (429, 503):
            self.t.request(f"retried:{r.status_code}")
            try:  # the server's Retry-After, honoured as the edge agent does (at most 5 s here)
                self.retry_after = min(5.0, float(r.headers.get("retry-after") or 0.25))
            except ValueError:
                self.retry_after = 0.25
            return "retry", str(r.status_code)
        if r.status_code >= 500 and not _is_app_error(r):  # Serve's proxy answering for a replica that died
            self.t.request(f"retried:proxy_{r.status_code}")
            return "retry", f"proxy_{r.status_code}"
        self.t.request(f"error:HTTP {r.status_code}")
        return "error", f"HTTP {r.status_code}: {r.text[:200]}"

    async def _open(self, prompt: list[int], out: list[int], deadline: float) -> dict | None:
        body = {"prompt_ids": prompt, "generated_ids": out, "sampling": {"max_tokens": self.max_tokens}}
        while time.monotonic() < deadline:
            kind, r = await self._send("POST", "/v1/sessions", json=body)
            if kind == "ok":
                self.t.opens += 1
                return r.json()
            if kind == "error":
                return None
            if not r.isdigit():  # not the app's own refusal: the open may have happened on a verifier
                self.t.lost_open_replies += 1
            await asyncio.sleep(self.retry_after * self.rng.uniform(0.5, 1.5) if r in ("429", "503") else 0.25)
        self.t.request("error:open: gave up")
        return None

    def _opened(self, d: dict, out: list[int]) -> tuple[str, int, bool]:
        """An open's answer: its first token onto ``out``; (session id, prefix length, finished)."""
        if d["first_token"] is not None:
            out.append(d["first_token"])
            self.t.tokens.append((time.time(), 1))
        self.t.live[self.seed] = (d["session_id"], len(out))
        return d["session_id"], d["prefix_len"], d["finished"]

    async def generation(self) -> None:
        i = self.next_prompt
        self.next_prompt = (self.next_prompt + 1) % len(self.prompts)
        prompt, truth = self.prompts[i], self.truths[i]
        deadline = time.monotonic() + self.give_up_s
        out: list[int] = []
        self.t.generations += 1
        d = await self._open(prompt, out, deadline)
        if d is None:
            return
        sid, prefix_len, finished = self._opened(d, out)
        from specdec.protocol import ReplyFrame, VerifyFrame

        while not finished:
            if time.monotonic() > deadline:
                self.t.request("error:generation: gave up")
                return
            tokens, parents = oracle_tree(truth[len(out):], self.rng, self.vocab)
            await asyncio.sleep(self.rtt_s)
            frame = VerifyFrame(prefix_len, tokens, parents, draft_ms=5.0, rtt_ms=self.rtt_s * 1e3, depth=8).encode()
            kind, r = await self._send("POST", f"/v1/sessions/{sid}/verify", content=frame)
            if kind == "ok":
                rep = ReplyFrame.decode(r.content)
                new = [tokens[j] for j in rep.accepted] + ([rep.bonus] if rep.bonus is not None else [])
                out.extend(new)
                self.t.tokens.append((time.time(), len(new)))
                self.t.live[self.seed] = (sid, len(out))
                prefix_len, finished = rep.prefix_len, rep.finished
                continue
            if kind == "error":
                return
            # the session's replica is gone, restarting, or the reply was lost: the server may still hold the
            # session (a reply lost on its way back): close it, then re-open from this edge's own history
            if kind == "retry":
                await self._close(sid)
                await asyncio.sleep(0.25)
            self.t.reopens += 1
            d = await self._open(prompt, out, deadline)
            if d is None:
                return
            sid, prefix_len, finished = self._opened(d, out)
        self.t.live.pop(self.seed, None)
        await self._close(sid)
        self.t.finished += 1
        self.t.outputs.setdefault(i, []).append(out)
        if out != truth[: len(out)] or len(out) != min(self.max_tokens, len(truth)):
            self.t.mismatched += 1

    async def _close(self, sid: str) -> None:
        for _ in range(20):
            try:
                r = await self.client.delete(f"/v1/sessions/{sid}", headers=self.headers)
            except Exception:  # noqa: BLE001
                await asyncio.sleep(0.25)
                continue
            if r.status_code in (200, 404, 410):
                self.t.closes += 1
                return
            await asyncio.sleep(0.25)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.generation()
            finally:  # a generation given up leaves no session for the fault to aim at
                self.t.live.pop(self.seed, None)


async def run_edges(url: str, n: int, prompts, truths, vocab: int, tally: Tally, stop: asyncio.Event,
                    max_tokens: int, rtt_s: float) -> None:
    import httpx

    limits = httpx.Limits(max_connections=n * 2, max_keepalive_connections=n * 2)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(30.0), limits=limits) as c:
        await asyncio.gather(*[Edge(c, prompts, truths, vocab, tally, seed=k, max_tokens=max_tokens,
                                    rtt_s=rtt_s).run(stop) for k in range(n)])


# ------------------------------------------------------------------------------------------ the cluster's state
def replicas(deployment: str = "Verifier", app: str = APP) -> dict[str, str]:
    """Alive replicas of ``deployment`` in the app: replica tag -> node id (from the GCS's actor table)."""
    import ray._private.state as state

    out = {}
    for a in state.actors().values():
        name = a.get("Name") or ""
        if a.get("State") == "ALIVE" and name.startswith(f"SERVE_REPLICA::{app}#{deployment}#"):
            out[name.rsplit("#", 1)[1]] = a["Address"]["NodeID"]
    return out


def serve_controller_id() -> str | None:
    import ray._private.state as state

    for aid, a in state.actors().items():
        if a.get("Name") == "SERVE_CONTROLLER_ACTOR" and a.get("State") == "ALIVE":
            return aid
    return None


def running_replicas(deployment: str = "Verifier", app: str = APP) -> int:
    from ray import serve

    st = serve.status().applications[app].deployments[deployment]
    return sum(n for s, n in st.replica_states.items() if str(getattr(s, "value", s)) == "RUNNING")


def alive_nodes() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def waited(pred, timeout_s: float, what: str, poll_s: float = 0.5) -> float | None:
    """:func:`wait_for`, None where ``pred`` did not come true within ``timeout_s`` (a check's outcome, reported)."""
    try:
        return wait_for(pred, timeout_s, what, poll_s)
    except TimeoutError:
        return None


def wait_for(pred, timeout_s: float, what: str, poll_s: float = 0.5) -> float:
    """Poll ``pred`` until true; returns the seconds it took; raises TimeoutError naming ``what``."""
    t0 = time.monotonic()
    while True:
        try:
            if pred():
                return time.monotonic() - t0
        except Exception:  # noqa: BLE001 (the GCS or a replica may still be coming back)
            pass
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(poll_s)


def orphans(url: str, tags, timeout_s: float = IDLE_TIMEOUT_S + 20) -> dict:
    """Sessions the verifiers hold once every edge closed its own (sessions whose open reply was lost), and how
    long until the idle sweep freed them all."""
    held = sessions_held(url, tags)
    freed = waited(lambda: sum(sessions_held(url, tags).values()) == 0, timeout_s, "orphaned sessions freed", 0.5)
    return {"sessions_held_after": held, "orphans_freed": freed is not None,
            "orphans_freed_after_s": None if freed is None else round(freed, 2)}


def sessions_held(url: str, tags) -> dict[str, int]:
    """Sessions each verifier replica holds, asked through the router (``/v1/stats?session_id=<tag>.x``)."""
    import httpx

    out = {}
    for tag in tags:
        r = httpx.get(f"{url}/v1/stats", params={"session_id": f"{tag}.x"},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        r.raise_for_status()
        st = r.json()
        out[st["replica"]] = st["sessions"]
    return out


# ------------------------------------------------------------------------------------------ figures
def window_counts(requests, t0: float, t1: float) -> dict:
    sel = [o for t, o in requests if t0 <= t < t1]
    return {"requests": len(sel), "ok": sum(o == "ok" for o in sel),
            "retried": sum(o.startswith("retried:") for o in sel), "errors": sum(o.startswith("error:") for o in sel)}


def throughput_recovery(tokens, fault_at: float, before_s: float = 4.0, window_s: float = 1.0,
                        share: float = 0.8) -> dict:
    """Tokens/s before the fault (``before_s``) and how long after it a ``window_s`` window first held ``share`` of
    that again (None: never within the run)."""
    base = sum(n for t, n in tokens if fault_at - before_s <= t < fault_at) / before_s
    ends = sorted({t for t, _ in tokens if t > fault_at})
    back = None
    for end in ends:
        start = end - window_s
        if start < fault_at:
            continue
        if sum(n for t, n in tokens if start < t <= end) / window_s >= share * base:
            back = end - fault_at
            break
    return {"tokens_per_s_before": round(base, 1), "full_throughput_after_s": None if back is None else round(back, 2),
            "share": share, "window_s": window_s}


def summary(t: Tally, refs: dict[int, list[int]]) -> dict:
    identical = all(o == refs[i] for i, outs in t.outputs.items() for o in outs)
    twins = {i: len(outs) for i, outs in t.outputs.items()}
    return {"generations": t.generations, "finished": t.finished, "mismatched": t.mismatched,
            "identical_to_reference": identical and t.mismatched == 0, "outputs_per_prompt": twins,
            "requests_ok": t.ok, "retried": t.retried, "errors": t.errors, "reopens": t.reopens,
            "lost_open_replies": t.lost_open_replies,
            "opens": t.opens, "closes": t.closes}


# ------------------------------------------------------------------------------------------ scenarios
class EdgesInBackground:
    """The edges on an event loop in a thread of their own, while this (main) thread acts on the cluster: Ray's
    node processes are started with the parent-death signal of the thread that starts them, so nodes and the
    GCS must be (re)started from a thread that outlives them."""

    def __init__(self, url, args, prompts, truths, vocab):
        import threading

        self.tally, self.error = Tally(), None
        self._stop = threading.Event()

        def run():
            async def main():
                stop = asyncio.Event()

                async def watch():
                    while not self._stop.is_set():
                        await asyncio.sleep(0.1)
                    stop.set()

                w = asyncio.ensure_future(watch())
                await run_edges(url, args.edges, prompts, truths, vocab, self.tally, stop, args.max_tokens,
                                args.rtt_ms / 1e3)
                await w

            try:
                asyncio.run(main())
            except BaseException as e:  # noqa: BLE001 (named in the result)
                self.error = f"{type(e).__name__}: {e}"

        self.thread = threading.Thread(target=run, name="edges", daemon=True)
        self.thread.start()

    def wait_first_generations(self, n: int, timeout_s: float = 120.0) -> None:
        wait_for(lambda: self.tally.finished >= n, timeout_s, "the edges' first generations", 0.1)

    def stop(self, timeout_s: float = 180.0) -> Tally:
        """Each edge finishes its generation and closes its session."""
        self._stop.set()
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError("the edges did not finish their generations")
        if self.error:
            raise RuntimeError(f"the edges failed: {self.error}")
        return self.tally


def node_loss(cluster, url: str, args, prompts, truths, vocab, refs) -> dict:
    """A worker node holding a verifier replica SIGKILLed under load; a node added back later."""
    before = replicas()
    routers = replicas("Router")
    workers = {n.node_id: n for n in cluster.alive_workers()}
    # the victim: a worker node with a verifier replica, one without a router replica if there is one
    cands = [nid for nid in workers if nid in before.values()]
    victim = min(cands, key=lambda nid: sum(v == nid for v in routers.values()))
    victim_tag = next(tag for tag, nid in before.items() if nid == victim)

    edges = EdgesInBackground(url, args, prompts, truths, vocab)
    try:
        edges.wait_first_generations(args.edges)  # every edge decoded once undisturbed
        time.sleep(args.settle_s)
        # the moment an edge's session on the victim's replica has at least half its generation to go (so
        # that edge must re-open: a session the replica holds may be in its last round, or closing)
        hit: list[str] = []

        def mid_generation() -> bool:
            hit[:] = [sid for sid, n in list(edges.tally.live.values())
                      if sid.partition(".")[0] == victim_tag and n <= args.max_tokens // 2]
            return bool(hit)

        held = sessions_held(url, [victim_tag])
        wait_for(mid_generation, 30, "an edge mid-generation on the victim", 0.01)
        t_kill = time.time()
        killed = cluster.kill_node(workers[victim])
        wait_for(lambda: victim not in alive_nodes(), 60, "the node declared dead", 0.2)
        t_dead = time.time() - t_kill
        time.sleep(args.after_fault_s)  # the edges decode on the surviving replicas
        two = replicas()
        t_add = time.time()
        node = cluster.add_worker()
        restored = wait_for(lambda: running_replicas() == args.verifiers
                            and len(set(replicas().values())) == args.verifiers,
                            args.restore_timeout_s, "Serve restoring the verifier replicas")
        time.sleep(args.settle_s)
    finally:
        tally = edges.stop()
    after = replicas()
    return {"scenario": "node-loss", "victim_node": victim, "victim_replica": victim_tag,
            "routers_on_victim": sum(v == victim for v in routers.values()),
            "replicas_before": before, "replicas_after_kill": two, "replicas_after": after,
            "replicas_on_distinct_nodes": len(set(after.values())) == len(after) == args.verifiers,
            "victim_replica_gone": victim_tag not in after, "added_node": node.node_id,
            "added_node_holds_a_replica": node.node_id in after.values(),
            "sessions_on_victim_before_kill": held.get(victim_tag, 0), "edges_mid_generation_on_victim": len(hit),
            "killed": killed,
            "declared_dead_after_s": round(t_dead, 2), "replica_count_restored_after_s": round(restored, 2),
            **orphans(url, after), "requests_before": window_counts(tally.requests, 0, t_kill),
            "requests_after_kill": window_counts(tally.requests, t_kill, t_add),
            "requests_after_node_back": window_counts(tally.requests, t_add, float("inf")),
            "throughput": throughput_recovery(tally.tokens, t_kill), **summary(tally, refs)}


def gcs_restart(cluster, url: str, args, prompts, truths, vocab, refs) -> dict:
    """The head's gcs_server SIGKILLed under load and restarted ``gcs_down_s`` later from Redis."""
    nodes0, controller0, reps0 = alive_nodes(), serve_controller_id(), replicas()
    edges = EdgesInBackground(url, args, prompts, truths, vocab)
    try:
        edges.wait_first_generations(args.edges)
        time.sleep(args.settle_s)
        ev = cluster.restart_gcs(args.gcs_down_s)
        back = wait_for(lambda: alive_nodes() >= nodes0, 120, "the GCS answering again", 0.2)
        time.sleep(args.after_fault_s)
    finally:
        tally = edges.stop()
    nodes1, controller1, reps1 = alive_nodes(), serve_controller_id(), replicas()
    # the restarted GCS creates actors again: a verifier replica killed now is replaced by Serve
    import ray

    tag = sorted(reps1)[0]
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#Verifier#{tag}", namespace="serve"), no_restart=True)
    replaced = waited(lambda: tag not in replicas() and running_replicas() == args.verifiers
                      and len(set(replicas().values())) == args.verifiers, args.restore_timeout_s,
                      "a replica replaced after the GCS restart")
    return {"scenario": "gcs-restart", **ev, "answering_after_restart_s": round(back, 2),
            "requests_before": window_counts(tally.requests, 0, ev["killed_at"]),
            "requests_during_outage": window_counts(tally.requests, ev["killed_at"], ev["started_at"]),
            "requests_after": window_counts(tally.requests, ev["started_at"], float("inf")),
            "same_nodes_alive": nodes1 == nodes0, "same_serve_controller": controller1 == controller0,
            "same_replicas": reps1 == reps0, "replica_replaced_after_restart": replaced is not None,
            "replica_replaced_after_restart_s": None if replaced is None else round(replaced, 2),
            **orphans(url, replicas()),
            "throughput": throughput_recovery(tally.tokens, ev["killed_at"]), **summary(tally, refs)}


# ------------------------------------------------------------------------------------------ main
def workload(n_prompts: int, max_tokens: int, seed: int = 1):
    """Prompts for the tiny target and their greedy continuations (the reference every output must equal)."""
    import torch

    from specdec.model.loading import tiny_random_model
    from specdec.reference import reference_decode
    from specdec.sampling import SamplingParams

    torch.set_num_threads(1)
    model = tiny_random_model(seed=TINY["seed"])
    vocab = model.config.vocab_size
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 32))] for _ in range(n_prompts)]
    truths = [reference_decode(model, p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    return prompts, truths, vocab


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma list of {SCENARIOS}")
    ap.add_argument("--out", required=True, help="JSON result file")
    ap.add_argument("--edges", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--verifiers", type=int, default=3, help="verifier replicas = nodes (head + workers)")
    ap.add_argument("--gcs-down-s", type=float, default=5.0)
    ap.add_argument("--settle-s", type=float, default=2.0)
    ap.add_argument("--after-fault-s", type=float, default=4.0)
    ap.add_argument("--restore-timeout-s", type=float, default=180.0)
    ap.add_argument("--no-redis", action="store_true", help="no GCS fault tolerance (node-loss only)")
    args = ap.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    for s in scenarios:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r}")
    if "gcs-restart" in scenarios and args.no_redis:
        ap.error("gcs-restart needs the Redis")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from deploy.request_path import RequestPathConfig
    from loadtests.cluster import LocalCluster

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    prompts, truths, vocab = workload(args.prompts, args.max_tokens)
    refs = dict(enumerate(truths))
    result: dict = {"args": vars(args), "scenarios": {}}
    t0 = time.time()
    # Serve's proxy on every node (the clients use the head's); gRPC between replicas as the project's default
    env = RequestPathConfig(ingress="proxy").env()
    with LocalCluster(workers=args.verifiers - 1, redis=not args.no_redis, env=env) as cluster:
        from ray import serve

        from deploy.application import build_app

        result["cluster_up_s"] = round(time.time() - t0, 1)
        cluster.start_serve()
        serve.run(build_app(app_args(args.verifiers)), name=APP, route_prefix="/")
        result["app_up_s"] = round(time.time() - t0, 1)
        url = f"http://127.0.0.1:{cluster.http_port}"
        import httpx

        result["proxies"] = {n.index: httpx.get(f"http://127.0.0.1:{n.proxy_port}/v1/health", timeout=30).status_code
                             for n in cluster.nodes}
        result["replicas_at_start"] = replicas()
        result["routers_at_start"] = replicas("Router")
        result["nodes_at_start"] = [n.node_id for n in cluster.nodes]
        result["redis"] = cluster.redis is not None
        for s in scenarios:
            t1 = time.time()
            fn = node_loss if s == "node-loss" else gcs_restart
            try:
                result["scenarios"][s] = fn(cluster, url, args, prompts, truths, vocab, refs)
            except Exception as e:  # noqa: BLE001 (recorded: the test names it)
                result["scenarios"][s] = {"scenario": s, "failed": f"{type(e).__name__}: {e}"}
            result["scenarios"][s]["wall_s"] = round(time.time() - t1, 1)
            out_path.write_text(json.dumps(result, indent=1, default=str))
            print(f"[loadtests.faults] {s}: {json.dumps(result['scenarios'][s], default=str)[:2000]}", flush=True)
    result["wall_s"] = round(time.time() - t0, 1)
    out_path.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
