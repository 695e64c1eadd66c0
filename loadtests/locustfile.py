"""Locust user: a simulated edge agent without a draft model (SpecEdge §4, §4.3).

Each user belongs to a tenant (API key from the app's own config) and loops over
generations: open a session (``POST /v1/sessions``, with ``close_on_finish`` as the edge agent
opens it), then verify rounds until the server says the generation finished (and closed the
session with that reply; an unfinished one is closed with ``DELETE``), then idle (think time). A round drafts a
synthetic tree from the target's known greedy continuation (:mod:`loadtests.synthetic_tree`),
waits the simulated draft time (depth x its device's ms per forward) plus its RTT (each user
has its own, log-normal around the median, jittered per round), and sends the binary
:class:`specdec.protocol.VerifyFrame` carrying that draft time and RTT, so the server's
pacing sees what a real edge would report; it follows the server's depth and tree-budget
hints unless the config fixes them. A share of the users (``ws_share``) verifies over one
WebSocket per session, as the edge agent does by default; the rest POST each round.
Protocol outcomes a real edge handles are not errors:
429 and 503 are retried after ``Retry-After``; 404/410 re-open the session with
``generated_ids``. Every verified token is checked against the target's continuation.

Run only as its own process(es) (``python -m loadtests.run`` does): gevent's monkey
patching and Ray in one process hang. Needs ``--loadtest-config FILE`` (written by
:func:`loadtests.workload.write_user_config`) and writes its counters to
``--loadtest-out FILE.<pid>`` when the process quits.
"""

from __future__ import annotations

import gc
import json
import os
import random
import time
from collections import defaultdict

import gevent
import websocket  # websocket-client: plain sockets, which Locust's gevent patches cooperative
from locust import FastHttpUser, between, events, task

from specdec import server_timing
from specdec.protocol import ReplyFrame, VerifyFrame
from loadtests import keepalive
from loadtests.synthetic_tree import AcceptanceModel, expected_accepted, synthetic_tree

keepalive.install()  # pooled connections past descriptor 1024 stay open (loadtests/keepalive.py)

CFG: dict = {}
STOPPING = False
MAX_RETRY_AFTER_S = 30.0  # the longest Retry-After honoured, as the edge agent (edge_agent/transport/)
WS_IDLE_CLOSE_S = 5.0  # a user about to sleep longer closes its WebSocket (uvicorn pings every 20 s)
LOST = -1  # status of a WebSocket round whose connection died after the frame went out
NO_CONNECTION = -2  # a WebSocket that could not be (re)connected: the frame never left, retried like a 503
LAG_PROBE_S = 0.05  # how often this process's own loop lag is sampled (a 429's client-side share)


class Counters:
    """What this Locust process saw, per tenant, plus per-second token buckets."""

    FIELDS = ("generations", "finished", "opens", "reopens", "closes", "superseded", "verifies", "tokens",
              "accepted", "drafted", "depth", "hits", "expected", "accept_mismatch", "diverged", "shed", "unavailable",
              "errors", "unclosed", "closed_by_server", "lost_replies", "lost_open_replies", "reconnects")

    def __init__(self):
        self.tenant = defaultdict(lambda: dict.fromkeys(self.FIELDS, 0))
        self.shed_reasons = defaultdict(int)
        self.error_kinds = defaultdict(int)
        self.tokens_by_second = defaultdict(lambda: defaultdict(int))  # epoch second -> tenant -> tokens
        self.verify_ms = defaultdict(list)  # tenant -> latencies of successful verifies
        self.verify_at = defaultdict(list)  # tenant -> epoch seconds of those verifies
        self.shed_ms: list[float] = []
        self.open_ms: list[float] = []  # latencies of admitted opens (the first token's time)
        self.open_at: list[float] = []  # and their epoch seconds
        self.shed_at: list[float] = []  # epoch seconds of those 429s
        self.shed_why: list[str] = []  # and their reasons
        self.shed_retry_after: list[float] = []  # and the Retry-After each carried (s)
        # (epoch s, seconds, kind) of each wait out of a Retry-After (429 or 503): "open" holding no
        # session, "verify" or "close" holding one
        self.backoffs: list[tuple[float, float, str]] = []
        self.shed_connect_ms: list[float] = []  # of each 429's time, what went to (re)connecting its WebSocket
        self.ws_lost: dict[str, int] = defaultdict(int)  # WebSocket rounds lost with their connection, by cause
        self.loop_lag: list[tuple[float, float]] = []  # (epoch s, ms) how late this process's gevent loop ran a timer
        self.loop_cpu: list[tuple[float, float]] = []  # (epoch s, share) of each lag sample's wall this process ran
        self.loop_cpu_s: list[tuple[float, float]] = []  # (epoch s, CPU seconds) this process ran in each lag sample
        self.gc_pause: list[tuple[float, float]] = []  # (epoch s, ms) each garbage collection stopped this process
        self.gc_gen: list[int] = []  # and its generation
        # (epoch s, ms) of each verify round's time outside the router: this process's time of it less the
        # router's own (its Server-Timing header): the loopback, this process's waits and its own CPU
        self.verify_outside: list[tuple[float, float]] = []

    def add(self, tenant: str, field: str, n: float = 1) -> None:
        self.tenant[tenant][field] += n

    def dump(self) -> dict:
        return {"pid": os.getpid(), "tenants": {t: dict(v) for t, v in self.tenant.items()},
                "shed_reasons": dict(self.shed_reasons), "error_kinds": dict(self.error_kinds),
                "tokens_by_second": {str(s): dict(v) for s, v in self.tokens_by_second.items()},
                "verify_ms": {t: [round(x, 2) for x in v] for t, v in self.verify_ms.items()},
                "verify_at": {t: [round(x, 2) for x in v] for t, v in self.verify_at.items()},
                "shed_ms": [round(x, 2) for x in self.shed_ms], "shed_at": [round(x, 2) for x in self.shed_at],
                "shed_why": self.shed_why, "shed_retry_after": self.shed_retry_after,
                "backoffs": [(round(t, 2), round(x, 3), k) for t, x, k in self.backoffs], "shed_connect_ms": [round(x, 2) for x in self.shed_connect_ms],
                "ws_lost": dict(self.ws_lost), "open_ms": [round(x, 2) for x in self.open_ms],
                "open_at": [round(x, 2) for x in self.open_at],
                "loop_lag_ms": [(round(t, 2), round(ms, 2)) for t, ms in self.loop_lag],
                "loop_cpu_share": [(round(t, 2), round(x, 3)) for t, x in self.loop_cpu],
                "loop_cpu_s": [(round(t, 2), round(x, 6)) for t, x in self.loop_cpu_s],
                "gc_pause_ms": [(round(t, 2), round(ms, 2)) for t, ms in self.gc_pause], "gc_gen": self.gc_gen,
                "verify_outside_ms": [(round(t, 2), round(ms, 2)) for t, ms in self.verify_outside]}


STATS = Counters()


def _app_error(body: bytes) -> bool:
    """Whether a body is the app's own JSON error (``{"error": {"code": ...}}``), not a proxy's plain 5xx."""
    try:
        d = json.loads(body)
    except ValueError:
        return False
    return isinstance(d, dict) and isinstance(d.get("error"), dict) and "code" in d["error"]
_assigned: dict[tuple[str, str], int] = defaultdict(int)
_user_seq = 0


@events.init_command_line_parser.add_listener
def _options(parser):
    parser.add_argument("--loadtest-config", type=str, default="", help="user config JSON from loadtests.run")
    parser.add_argument("--loadtest-out", type=str, default="", help="where this process writes its counters")


@events.init.add_listener
def _init(environment, **_):
    opts = environment.parsed_options
    if opts is None or not opts.loadtest_config:
        raise SystemExit("loadtests/locustfile.py needs --loadtest-config (run it through python -m loadtests.run)")
    CFG.update(json.loads(open(opts.loadtest_config).read()))
    u = CFG["user"]
    EdgeUser.network_timeout = EdgeUser.connection_timeout = float(u["network_timeout_s"])
    lo, hi = u["idle_s"]
    EdgeUser.wait_time = between(lo, hi)


@events.test_start.add_listener
def _start_lag_probe(**_):
    gevent.spawn(_lag_probe)
    gc.callbacks.append(_gc_probe)


def _lag_probe() -> None:
    """How late the gevent loop wakes a sleeper: the wait a reply that has arrived meets before its
    user reads it (the client's share of every measured latency, 429s included); and the share of
    that wall this process ran (near 1: its own work or a collection held the loop; low: the CPU was
    elsewhere)."""
    while not STOPPING:
        t0, c0 = time.perf_counter(), time.process_time()
        gevent.sleep(LAG_PROBE_S)
        wall = time.perf_counter() - t0
        STATS.loop_lag.append((time.time(), max(0.0, wall - LAG_PROBE_S) * 1e3))
        cpu = time.process_time() - c0
        STATS.loop_cpu.append((time.time(), cpu / wall))
        STATS.loop_cpu_s.append((time.time(), cpu))


_gc_started = [0.0]


def _gc_probe(phase: str, info: dict) -> None:
    """gc.callbacks: each collection's pause, by generation."""
    if phase == "start":
        _gc_started[0] = time.perf_counter()
    else:
        STATS.gc_pause.append((time.time(), (time.perf_counter() - _gc_started[0]) * 1e3))
        STATS.gc_gen.append(info["generation"])


@events.test_stopping.add_listener
def _stopping(**_):
    global STOPPING
    STOPPING = True  # users close their sessions after the request in flight
    if _gc_probe in gc.callbacks:
        gc.callbacks.remove(_gc_probe)


@events.quitting.add_listener
def _write(environment, **_):
    out = environment.parsed_options.loadtest_out if environment.parsed_options else ""
    if out:
        with open(f"{out}.{os.getpid()}", "w") as f:  # one file per process (--processes forks several)
            json.dump(STATS.dump(), f)


def _smooth_pick(kind: str, shares: dict[str, float]) -> str:
    """Smooth assignment of users to the keys of ``shares`` (tenants, devices, transports)."""
    total = sum(shares.values())
    t = min((n for n in shares if shares[n] > 0),
            key=lambda n: (_assigned[kind, n] + 1) / (shares[n] / total))
    _assigned[kind, t] += 1
    return t


class EdgeUser(FastHttpUser):
    wait_time = between(2.0, 8.0)  # replaced from the config at init

    def on_start(self):
        global _user_seq
        _user_seq += 1
        self.tenant = _smooth_pick("tenant", CFG["shares"])
        self.headers = {"Authorization": f"Bearer {CFG['keys'][self.tenant]}"}
        self.rng = random.Random(_user_seq * 7919 + os.getpid())
        u = CFG["user"]
        self.model = AcceptanceModel(u["alpha"], u["sibling_alpha"])
        self.device = _smooth_pick("device", u["devices"]) if u["devices"] else None
        self.draft_ms = CFG["device_draft_ms"][self.device] if self.device else u["draft_ms"]
        self.rtt_ms = u["rtt_ms"] * self.rng.lognormvariate(0.0, u["rtt_sigma"])  # this user's network
        self.ws = _smooth_pick("transport", {"ws": u["ws_share"], "http": 1 - u["ws_share"]}) == "ws"
        self.sock: websocket.WebSocket | None = None
        self.sock_sid: str | None = None
        self.connect_ms = 0.0  # the last request's time spent connecting a WebSocket (0: none, or HTTP)
        wl = CFG["workload"]
        self.vocab = wl["vocab_size"]

    # -- one HTTP exchange, named by outcome in Locust's stats --------------------------------
    def _request(self, method: str, path: str, name: str, **kw):
        """Returns (status, body bytes, headers, ms); 429/503/404/410 are protocol outcomes, not failures."""
        self.connect_ms = 0.0
        t0 = time.perf_counter()
        with self.client.request(method, path, name=name, headers=self.headers, catch_response=True, **kw) as r:
            ms = (time.perf_counter() - t0) * 1000
            status = r.status_code or 0
            body = r.content or b""
            if status in (429, 503, 404, 410):
                r.request_meta["name"] = f"{name} {status}"
                r.success()
            elif status == 200:
                r.success()
            elif status == 0 or (status >= 500 and not _app_error(body)):
                # a dropped connection or Serve's proxy answering for a router replica that died with its node:
                # the request may or may not have been served; the user retries (opens) or re-opens (rounds)
                r.request_meta["name"] = f"{name} lost"
                r.success()
                status = LOST
            else:
                r.failure(f"HTTP {status}: {body[:200]!r}" if status else f"connection error: {r.error}")
            return status, body, r.headers or {}, ms

    def _verify(self, sid: str, frame: bytes):
        return self._verify_ws(sid, frame) if self.ws else self._request(
            "POST", f"/v1/sessions/{sid}/verify", "verify", data=frame)

    def _verify_ws(self, sid: str, frame: bytes):
        """One round over the session's WebSocket (connected on first use, as the edge agent):
        (status, body, headers, ms) like :meth:`_request`; a JSON text reply is an error with
        its status; a connection that dies after the frame went out is ``LOST``, one that cannot
        be made is status 0 (an error)."""
        t0 = time.perf_counter()
        self.connect_ms = 0.0
        name, status, body, headers, exc, sent = "ws verify", 0, b"", {}, None, False
        try:
            try:
                self._ws_for(sid).send_binary(frame)
            except (websocket.WebSocketConnectionClosedException, BrokenPipeError, ConnectionResetError):
                # the server closed an idle socket (uvicorn's ping went unanswered while this user
                # slept out a Retry-After): the frame was not delivered; reconnect and send it once
                self._close_ws()
                self._ws_for(sid).send_binary(frame)
            sent = True
            opcode, body = self.sock.recv_data()
            if opcode == websocket.ABNF.OPCODE_BINARY:
                status = 200
            elif opcode == websocket.ABNF.OPCODE_CLOSE:
                raise websocket.WebSocketConnectionClosedException(f"closed by the server: {body[2:]!r}")
            else:
                err = json.loads(body)
                status = int(err.get("status", 0))
                if err.get("retry_after") is not None:
                    headers = {"Retry-After": str(err["retry_after"])}
                if status in (429, 503, 404, 410):
                    name = f"ws verify {status}"
                else:
                    exc = RuntimeError(f"HTTP {status}: {body[:200]!r}")
        except (websocket.WebSocketException, OSError) as e:
            self._close_ws()
            if sent:  # whether the server applied the round is unknown: the generation ends that
                # session and re-opens from its own history (as the agent)
                status, name = LOST, "ws verify lost"
                STATS.ws_lost[type(e).__name__] += 1
            else:  # the frame never left (the socket could not be made): the round is retried
                status, name = NO_CONNECTION, "ws verify no connection"
                STATS.ws_lost[f"connect {type(e).__name__}"] += 1
        except ValueError as e:  # a text reply that is not our JSON error
            self._close_ws()
            exc = e
        ms = (time.perf_counter() - t0) * 1000
        events.request.fire(request_type="WS", name=name, response_time=ms, response_length=len(body),
                            exception=exc, context={})
        return status, body, headers, ms

    def _ws_for(self, sid: str) -> websocket.WebSocket:
        """The session's WebSocket, connected on first use."""
        if self.sock_sid != sid or self.sock is None:
            self._close_ws()
            url = self.host.replace("http://", "ws://", 1) + f"/v1/sessions/{sid}/ws"
            t0 = time.perf_counter()
            self.sock = websocket.create_connection(url, header=[f"Authorization: {self.headers['Authorization']}"],
                                                    timeout=float(CFG["user"]["network_timeout_s"]))
            self.connect_ms += (time.perf_counter() - t0) * 1000  # inside the round's time, reported apart too
            self.sock_sid = sid
        return self.sock

    def _close_ws(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except (websocket.WebSocketException, OSError):
                pass
        self.sock, self.sock_sid = None, None

    def _backoff(self, status: int, body: bytes, headers, ms: float, kind: str) -> None:
        """Waits out a 429's or 503's Retry-After (``kind``: the request it answered), as the edge agent."""
        s = STATS
        reason = "unavailable"
        try:
            reason = json.loads(body).get("error", {}).get("reason") or json.loads(body)["error"]["code"]
        except (ValueError, KeyError, AttributeError, TypeError):
            pass
        try:
            wait = float(headers.get("Retry-After") or headers.get("retry-after") or 1.0)
        except ValueError:
            wait = 1.0
        if status == 429:
            s.add(self.tenant, "shed")
            s.shed_ms.append(ms)
            s.shed_at.append(time.time())
            s.shed_reasons[reason] += 1
            s.shed_why.append(reason)
            s.shed_retry_after.append(wait)
            s.shed_connect_ms.append(self.connect_ms)
        else:
            s.add(self.tenant, "unavailable")
        # sleep in slices: a run that ends meanwhile must not wait out a long Retry-After (the session
        # is closed before Locust's stop timeout kills the user)
        until = time.monotonic() + min(wait, MAX_RETRY_AFTER_S) * self.rng.uniform(0.5, 1.5)
        s.backoffs.append((time.time(), until - time.monotonic(), kind))
        if until - time.monotonic() > WS_IDLE_CLOSE_S:
            self._close_ws()  # nobody answers the server's keep-alive pings meanwhile: let the socket go
        while not STOPPING and time.monotonic() < until:
            gevent.sleep(min(0.25, until - time.monotonic()))

    def _error(self, kind: str) -> None:
        STATS.add(self.tenant, "errors")
        STATS.error_kinds[kind] += 1

    def _open(self, prompt: list[int], generated: list[int]) -> dict | None:
        body = json.dumps({"prompt_ids": prompt, "generated_ids": generated, "sampling": {
            "max_tokens": CFG["user"]["max_tokens"]}, "client": {"draft_ms": CFG["user"]["draft_ms"],
                                                                 "rtt_ms": CFG["user"]["rtt_ms"],
                                                                 "agent": "loadtest"},
                           "close_on_finish": True})
        for _ in range(CFG["user"]["max_retries"]):
            if STOPPING:
                return None
            status, data, headers, ms = self._request("POST", "/v1/sessions", "open", data=body.encode())
            if status == 200:
                STATS.add(self.tenant, "opens")
                STATS.open_ms.append(ms)
                STATS.open_at.append(time.time())
                return json.loads(data)
            if status in (429, 503):
                self._backoff(status, data, headers, ms, "open")
                continue
            if status == LOST:  # maybe opened on a verifier, reply lost (the verifier's idle sweep frees it)
                STATS.add(self.tenant, "lost_open_replies")
                self._backoff(503, b"", {"Retry-After": "0.5"}, ms, "open")
                continue
            self._error(f"open HTTP {status}")
            return None
        self._error("open: retries exhausted")
        return None

    def _close(self, sid: str) -> None:
        self._close_ws()
        for _ in range(5):  # a replica restarting answers 503: retry after its Retry-After, as the agent
            status, data, headers, ms = self._request("DELETE", f"/v1/sessions/{sid}", "close")
            if status not in (429, 503, LOST):
                break
            if status == LOST:  # a router replica gone with its node: ask again
                status, headers = 503, {"Retry-After": "0.5"}
            self._backoff(status, data, headers, ms, "close")
        if status == 200:
            STATS.add(self.tenant, "closes")
        elif status in (404, 410):  # already gone with its replica (or evicted): nothing left to close
            STATS.add(self.tenant, "closes")
            STATS.add(self.tenant, "closed_gone")
        else:
            STATS.add(self.tenant, "unclosed")
            self._error(f"close HTTP {status}")

    # -- one generation -----------------------------------------------------------------------
    @task
    def generation(self):
        if STOPPING:
            return
        u, wl, s = CFG["user"], CFG["workload"], STATS
        i = self.rng.randrange(len(wl["prompts"]))
        prompt, truth = wl["prompts"][i], wl["truths"][i]
        out: list[int] = []
        s.add(self.tenant, "generations")
        d = self._open(prompt, out)
        if d is None:
            return
        sid, prefix_len, finished = d["session_id"], d["prefix_len"], d["finished"]
        depth_hint, budget_hint = d["depth_hint"], d["budget_hint"]
        diverged = False
        if d["first_token"] is not None:
            out.append(d["first_token"])
            self._count_tokens(1)
            if out[0] != truth[0]:
                diverged = True
                s.add(self.tenant, "diverged")
        retries = 0
        while not finished and not STOPPING:
            depth = u["depth"] or max(1, depth_hint)
            nodes = min(u["nodes"] or max(1, budget_hint), CFG["max_tree_nodes"])
            depth = min(depth, nodes, CFG["max_tree_depth"])
            rest = truth[len(out):] if not diverged else []
            tokens, parents, hits = synthetic_tree(rest, self.model, depth, nodes, self.vocab, self.rng)
            draft_ms = depth * self.draft_ms * self.rng.uniform(1 - u["jitter"], 1 + u["jitter"])
            rtt_ms = self.rtt_ms * self.rng.uniform(1 - u["jitter"], 1 + u["jitter"])
            gevent.sleep((draft_ms + rtt_ms) / 1000.0)  # the edge drafts, then the frame travels
            frame = VerifyFrame(prefix_len, tokens, parents, draft_ms=self.draft_ms, rtt_ms=rtt_ms,
                                depth=depth).encode()
            while True:
                status, data, headers, ms = self._verify(sid, frame)
                if status in (429, 503, NO_CONNECTION) and retries < u["max_retries"] and not STOPPING:
                    retries += 1
                    if status == NO_CONNECTION:
                        STATS.add(self.tenant, "reconnects")
                        status, headers = 503, {"Retry-After": "0.5"}
                    self._backoff(status, data, headers, ms, "verify")
                    continue
                break
            if status == 200:
                retries = 0
                rep = ReplyFrame.decode(data)
                new = [tokens[j] for j in rep.accepted] + ([rep.bonus] if rep.bonus is not None else [])
                if not diverged:
                    # (max_tokens may cut the last round; the replica may verify only a prefix of the
                    # tree at batch time, and then the tree's known hits do not apply)
                    if len(rest) > depth and rep.verified is None and len(rep.accepted) != hits:
                        s.add(self.tenant, "accept_mismatch")
                    if new != truth[len(out):len(out) + len(new)]:
                        diverged = True  # the server's tokens left the target's greedy continuation
                        s.add(self.tenant, "diverged")
                out.extend(new)
                now = time.time()
                s.add(self.tenant, "verifies")
                s.add(self.tenant, "accepted", len(rep.accepted))
                s.add(self.tenant, "drafted", len(tokens))
                s.add(self.tenant, "depth", depth)
                s.add(self.tenant, "hits", hits)
                s.add(self.tenant, "expected", expected_accepted(self.model, depth, len(rest), nodes))
                s.verify_ms[self.tenant].append(ms)
                s.verify_at[self.tenant].append(now)
                served = server_timing.router_ms(headers.get(server_timing.HEADER))
                if served is not None:
                    s.verify_outside.append((now, ms - served))
                self._count_tokens(len(new))
                prefix_len, finished = rep.prefix_len, rep.finished
                depth_hint, budget_hint = rep.depth_hint or depth_hint, rep.budget_hint or budget_hint
                continue
            if status in (404, 410, LOST):  # evicted or lost with its replica: re-open from our own history
                if status == LOST:
                    s.add(self.tenant, "lost_replies")
                    self._close(sid)  # the server may still hold it: close it first
                else:
                    s.add(self.tenant, "superseded")
                s.add(self.tenant, "reopens")
                d = self._open(prompt, out)
                if d is None:
                    return
                sid, prefix_len, finished = d["session_id"], d["prefix_len"], d["finished"]
                if d["first_token"] is not None:  # a re-open samples the next token like a round's bonus
                    if not diverged and d["first_token"] != (truth[len(out)] if len(out) < len(truth) else None):
                        diverged = True
                        s.add(self.tenant, "diverged")
                    out.append(d["first_token"])
                    self._count_tokens(1)
                continue
            if STOPPING and status in (429, 503):
                break
            self._error(f"verify HTTP {status}" if status else "verify: connection error")
            break
        if finished:
            s.add(self.tenant, "finished")
        if finished and d.get("close_on_finish"):  # the server closed it with its finishing reply
            self._close_ws()
            s.add(self.tenant, "closes")
            s.add(self.tenant, "closed_by_server")
        else:
            self._close(sid)

    def _count_tokens(self, n: int) -> None:
        STATS.add(self.tenant, "tokens", n)
        STATS.tokens_by_second[int(time.time())][self.tenant] += n
