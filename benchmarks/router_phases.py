"""The router's CPU by phase of a request, from a sampling profile of its process under load: the
shares the simulation spends before admission, after it before the verifier call, and reading the
reply (``sim.cost_profile.HostCost``: ``admit_share``, ``reply_share``).

``python -m benchmarks.router_phases record --users 300`` runs a ``loadtests.run`` ramp, attaches
py-spy (``--nonblocking``: the router is never paused) to the router's process for ``--seconds`` of
its steady window, and writes the phase counts as JSON; ``classify FILE`` reads a py-spy ``raw``
profile already taken. Each sample of the router's asyncio thread is put in one phase by its stack
(:func:`phase`); samples of the loop itself and of its other tasks (metrics pushes, watchdogs) are
overhead spread over the phases pro rata; gRPC's compiled unary call runs both the request's send
and its reply's receipt under one Python frame, so its samples are split evenly between the two
(the one assumption, stated in the JSON). Samples of other threads (Ray's worker loop) are not
per-request work and are left out.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

PHASES = ("before_admission", "send", "reply", "grpc_call", "loop", "other_thread")
GRPC_SPLIT = 0.5  # of the compiled unary call's samples, the share that is the reply's receipt
# the frames that put a sample in a phase, matched against "function (file:line)"
SEND_FILES = ("ray/serve/_private/router.py", "request_router/", "replica_wrapper.py", "ray/serve/handle.py",
              "grpc/aio/_interceptor.py", "grpc_authentication")
REPLY_FRAMES = ("RequestResponseCycle.send ", "send_with_request_id", "ServerErrorMiddleware.__call__.<locals>._send",
                "wrapped_app.<locals>.sender", "send_user_message", "_record_errors_and_metrics", "Logger.",
                "ray/serve/metrics.py", "replica_result.py")
AWAIT_FRAMES = ("DeploymentResponse.__await__", "replica_result.py")
REQUEST_FRAMES = ("call_asgi", "run_asgi", "httptools_impl", "fast_shed.py", "Router.verify_http",
                  "_direct_ingress_asgi")


def _grpc_await_line() -> int:
    """The line of ``UnaryUnaryCall._invoke``'s ``await self._cython_call.unary_unary(`` in the installed grpcio
    (595 in 1.7x)."""
    try:
        import inspect

        from grpc.aio import _call

        lines, first = inspect.getsourcelines(_call.UnaryUnaryCall._invoke)
        return next(first + i for i, text in enumerate(lines) if "self._cython_call.unary_unary(" in text)
    except (ImportError, OSError, StopIteration, AttributeError):
        return 595


GRPC_AWAIT_LINE = _grpc_await_line()


@dataclass(frozen=True)
class RouterPhases:
    """Samples by phase (:data:`PHASES`) and the shares the simulation takes from them."""

    counts: dict[str, int]
    source: str = ""

    @property
    def request_samples(self) -> float:
        c = self.counts
        return c["before_admission"] + c["send"] + c["reply"] + c["grpc_call"]

    @property
    def reply_share(self) -> float:
        """Of the router's per-request CPU, the share spent reading the reply (``HostCost.reply_share``)."""
        c = self.counts
        return (c["reply"] + GRPC_SPLIT * c["grpc_call"]) / self.request_samples

    @property
    def admit_share(self) -> float:
        """Of its CPU before the call, the share before admission (``HostCost.admit_share``)."""
        c = self.counts
        before = c["before_admission"] + c["send"] + (1 - GRPC_SPLIT) * c["grpc_call"]
        return c["before_admission"] / before

    def to_dict(self) -> dict:
        return {**asdict(self), "reply_share": round(self.reply_share, 4), "admit_share": round(self.admit_share, 4),
                "grpc_call_split": GRPC_SPLIT,
                "method": "py-spy --nonblocking samples of the router's asyncio thread, by stack "
                          "(benchmarks/router_phases.py); the loop's own samples spread pro rata"}


def _line(frame: str) -> int:
    m = re.search(r":(\d+)\)$", frame)
    return int(m.group(1)) if m else -1


def phase(frames: list[str]) -> str:
    """The phase of one sample: ``frames`` outermost first, the first its thread's name."""
    if "AsyncIO Thread" not in frames[0]:
        return "other_thread"
    for i, f in enumerate(frames):
        if "UnaryUnaryCall._invoke" in f:
            if _line(f) == GRPC_AWAIT_LINE and i == len(frames) - 1:
                return "grpc_call"
            return "reply" if _line(f) > GRPC_AWAIT_LINE else "send"
        if f.startswith("Router._admitted_call "):  # admission.check/started, then the call, then the probe
            inner = frames[i + 1] if i + 1 < len(frames) else ""
            if inner.startswith(("AdmissionControl.check", "AdmissionControl.started")):
                return "before_admission"
            if not inner.startswith("Router._call "):
                return "reply"
            below = ";".join(frames[i + 2:])  # the handle's remote() and send, or the response awaited
            return "reply" if any(k in below for k in AWAIT_FRAMES) else "send"
        if f.startswith("Router._verify ") and (
                i + 1 == len(frames) or not frames[i + 1].startswith("Router._admitted_call ")):
            return "reply"  # the reply's outcome, the tenant's count, the metrics
    text = ";".join(frames)
    if any(k in text for k in REPLY_FRAMES):
        return "reply"
    if any(k in text for k in SEND_FILES):
        return "send"
    if any(k in text for k in REQUEST_FRAMES):
        return "before_admission"
    return "loop"


def classify(lines, source: str = "") -> RouterPhases:
    """A py-spy ``--format raw --threads`` profile (``frame;frame;... count`` lines) by phase."""
    counts = Counter({p: 0 for p in PHASES})
    for line in lines:
        line = line.rstrip()
        if not line:
            continue
        stack, n = line.rsplit(" ", 1)
        counts[phase(stack.split(";"))] += int(n)
    if not counts["before_admission"] or not counts["reply"]:
        raise ValueError(f"{source or 'the profile'}: no request samples of the router (is it the router's process, "
                         "under load, profiled with --threads?)")
    return RouterPhases(dict(counts), source)


def router_pid() -> int | None:
    out = subprocess.run(["pgrep", "-f", "ServeReplica:.*:Router"], capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else None


def record(users: int, seconds: float, settle_s: float, out: Path) -> RouterPhases:
    """A ``loadtests.run`` ramp of ``users`` (spawn 200 a second, 60 s); py-spy on its router for
    ``seconds`` from ``settle_s`` after Locust starts."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "loadtest.log").open("w")
    lt = subprocess.Popen([sys.executable, "-m", "loadtests.run", "--scenario", "ramp", "--users", str(users),
                           "--spawn-rate", "200", "--duration", "60s", "--out", str(out / "loadtest")],
                          stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while f"{users} users, spawn rate" not in (out / "loadtest.log").read_text():
            if lt.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the load test did not start: {out / 'loadtest.log'}")
            time.sleep(0.5)
        pid = router_pid()
        if pid is None:
            raise RuntimeError("no router process (ServeReplica:*:Router) found")
        time.sleep(settle_s)
        raw = out / "router.pyspy.txt"
        subprocess.run([spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "200",
                        "--format", "raw", "--nonblocking", "--threads", "-o", str(raw)], check=True,
                       capture_output=True)
        lt.wait(timeout=600)
    finally:
        if lt.poll() is None:
            lt.terminate()
            lt.wait(timeout=60)
        log.close()
    return classify(raw.read_text().splitlines(), f"loadtests.run ramp {users} users, py-spy {seconds:g} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.router_phases", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="a load test with py-spy on its router")
    r.add_argument("--users", type=int, default=300)
    r.add_argument("--seconds", type=float, default=30.0)
    r.add_argument("--settle-s", type=float, default=12.0, help="after Locust starts: its spawn and warm-up")
    r.add_argument("--out", default=".cache/router-phases")
    c = sub.add_parser("classify", help="a py-spy raw profile of the router already taken")
    c.add_argument("profile")
    for p in (r, c):
        p.add_argument("--json", default=None, help="also write the phases here")
    args = ap.parse_args(argv)
    try:
        ph = (record(args.users, args.seconds, args.settle_s, Path(args.out)) if args.cmd == "record" else
              classify(Path(args.profile).read_text().splitlines(), args.profile))
    except (OSError, ValueError, RuntimeError, subprocess.SubprocessError) as e:
        print(f"python -m benchmarks.router_phases: {e}", file=sys.stderr)
        return 2
    d = ph.to_dict()
    total = sum(ph.counts.values())
    for k in PHASES:
        print(f"{k:18s} {ph.counts[k]:7d} samples {ph.counts[k] / total:6.1%}")
    print(f"reply_share {d['reply_share']:.3f}, admit_share {d['admit_share']:.3f} ({d['source']})")
    if args.json:
        Path(args.json).write_text(json.dumps(d, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
