"""A latency probe beside the load: the rounds of one light client that is not itself overloaded.

Locust measures every round from inside a gevent loop that serves hundreds of users. On a
machine it shares with the server that loop lags by 80-170 ms at p99 by itself
(``loadtests/README.md``), so Locust's own 429 latency cannot show whether the *server*
answers a shed round within 100 ms. This probe is a second client, in its own process, that
sends a few verify rounds per second and times each one from the socket:

- under the key of the tenant with the largest share of the users (the one the router sheds
  first), with a workload prompt, two threads, each on its own keep-alive connection:
- *verify*: one session at a time and its verify rounds over HTTP POST, each an empty tree (a
  plain decoding round: one target token); a finished session is closed and another opened,
  a 404/410 (evicted) opens another;
- *open*: session opens (``POST /v1/sessions``), each closed again at once when admitted: under
  saturation the router sheds new sessions first ("running sessions go first"), so most 429s
  of a loaded run are answers to opens;
- each paced at ``--rate`` / 2 per second whatever the answer: a 429's ``Retry-After`` is
  recorded, not obeyed (the probe measures; at 20 requests/s beside the 450-650 per second of a
  1000-user run its share is small, though each admitted open costs the verifier a prefill).

:func:`loadtests.run.start_probe` starts it at real-time priority (``chrt -f``) where the
user may, else at nice -10, else as it is, and the report states which. It writes one JSON:
each request's start time, kind, status and milliseconds, and a summary per kind and status
(the report's own ``percentile``). No gevent, no torch: nothing here competes with the server
for more than a few ms/s.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from specdec.protocol import ReplyFrame, VerifyFrame
from loadtests.report import percentile


def summarise(rounds: list[dict]) -> dict:
    """Per kind and status ("verify 200", "open 429"): count, p50, p99 and max milliseconds."""
    by: dict[str, list[float]] = {}
    for r in rounds:
        by.setdefault(f"{r['kind']} {r['status']}", []).append(r["ms"])
    return {k: {"n": len(v), "p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99), "max_ms": max(v)}
            for k, v in sorted(by.items())}


class Probe:
    def __init__(self, url: str, key: str, prompt: list[int], max_tokens: int, timeout_s: float = 10.0):
        u = urlsplit(url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout_s)
        self.headers = {"Authorization": f"Bearer {key}"}
        self.prompt, self.max_tokens = prompt, max_tokens
        self.sid: str | None = None
        self.prefix_len = 0

    def _call(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes, float]:
        t0 = time.perf_counter()
        try:
            self.conn.request(method, path, body=body, headers=self.headers)
            r = self.conn.getresponse()
            data = r.read()
            status = r.status
        except (OSError, http.client.HTTPException):
            self.conn.close()  # reconnects on the next request
            status, data = 0, b""
        return status, data, (time.perf_counter() - t0) * 1000.0

    def open(self) -> dict:
        """One session open (timed); the session becomes this probe's."""
        body = json.dumps({"prompt_ids": self.prompt, "sampling": {"max_tokens": self.max_tokens},
                           "client": {"agent": "loadtest-probe"}}).encode()
        t = time.time()
        status, data, ms = self._call("POST", "/v1/sessions", body)
        if status == 200:
            d = json.loads(data)
            self.sid, self.prefix_len = d["session_id"], d["prefix_len"]
            if d.get("finished"):
                self._close()
        return {"t": t, "kind": "open", "status": status, "ms": ms}

    def open_and_close(self) -> dict:
        r = self.open()
        self._close()
        return r

    def _close(self) -> None:
        if self.sid is not None:
            self._call("DELETE", f"/v1/sessions/{self.sid}")
        self.sid = None

    def round(self) -> dict:
        """One verify round, or the open of the session it needs first."""
        if self.sid is None:
            r = self.open()
            if self.sid is None:
                return r
        frame = VerifyFrame(self.prefix_len, [], []).encode()
        t = time.time()
        status, data, ms = self._call("POST", f"/v1/sessions/{self.sid}/verify", frame)
        if status == 200:
            rep = ReplyFrame.decode(data)
            self.prefix_len = rep.prefix_len
            if rep.finished:
                self._close()
        elif status in (404, 410):
            self.sid = None
        return {"t": t, "kind": "verify", "status": status, "ms": ms}

    def run(self, step, rate: float, duration_s: float) -> list[dict]:
        """``step()`` paced at ``rate`` per second (a late step starts the next at once)."""
        out: list[dict] = []
        period, t_next = 1.0 / rate, time.monotonic()
        end = t_next + duration_s
        while time.monotonic() < end:
            out.append(step())
            t_next += period
            time.sleep(max(0.0, t_next - time.monotonic()))
        self._close()
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", required=True, help="the app's URL (the edges' port)")
    ap.add_argument("--users-config", required=True, help="the users.json the Locust users read")
    ap.add_argument("--rate", type=float, default=20.0, help="verify rounds per second")
    ap.add_argument("--duration", type=float, required=True, help="seconds")
    ap.add_argument("--out", required=True)
    ap.add_argument("--priority", default="as started", help="how it was started (recorded in the output)")
    args = ap.parse_args(argv)
    if args.rate <= 0 or args.duration <= 0:
        ap.error("--rate and --duration must be positive")
    cfg = json.loads(Path(args.users_config).read_text())
    tenant = max(cfg["shares"], key=cfg["shares"].get)  # the tenant with the most users: shed first
    probes = [Probe(args.host, cfg["keys"][tenant], cfg["workload"]["prompts"][0], int(cfg["user"]["max_tokens"]))
              for _ in range(2)]
    results: list[list[dict]] = [[], []]
    threads = [threading.Thread(target=lambda i=i, step=step: results[i].extend(
                   probes[i].run(step, args.rate / 2, args.duration)), name=f"probe-{i}")
               for i, step in enumerate((probes[0].round, probes[1].open_and_close))]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rounds = sorted(results[0] + results[1], key=lambda r: r["t"])
    Path(args.out).write_text(json.dumps({
        "started": t0, "ended": time.time(), "rate": args.rate, "tenant": tenant, "priority": args.priority,
        "summary": summarise(rounds), "rounds": rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
