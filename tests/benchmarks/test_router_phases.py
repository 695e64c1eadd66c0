"""benchmarks/router_phases.py: a py-spy profile of the router read as CPU by phase of a request."""

from __future__ import annotations

import pytest

from benchmarks.router_phases import GRPC_AWAIT_LINE, classify, phase

LOOP = "thread (5979): AsyncIO Thread: default"
BOOT = [LOOP, "Thread._bootstrap (threading.py:1002)", "Thread._bootstrap_inner (threading.py:1045)",
        "Thread.run (threading.py:982)"]
# an HTTP verify's frames down to the router's own code, as py-spy records them (its shape under Serve's direct ingress)
ASGI = [LOOP, "Replica._direct_ingress_asgi.<locals>.call_asgi (ray/serve/_private/replica.py:3309)",
        "UserCallableWrapper._call_http_entrypoint (ray/serve/_private/replica.py:1804)",
        "ShedFastPath.__call__ (deploy/router/fast_shed.py:120)",
        "run_endpoint_function (fastapi/routing.py:212)", "Router.verify_http (deploy/router/ingress.py:320)",
        "Router.verify (deploy/router/ingress.py:260)", "Router._verify (deploy/router/ingress.py:271)"]
ADMITTED = [*ASGI, "Router._admitted_call (deploy/router/ingress.py:193)",
            "Router._call (deploy/router/ingress.py:179)"]

SAMPLES = {
    "before_admission": [
        [*ASGI[:4], "admission_refusal (deploy/router/fast_shed.py:60)"],
        [*ASGI, "Router._admitted_call (deploy/router/ingress.py:189)",
         "AdmissionControl.check (deploy/router/admission.py:70)"],
        [LOOP, "RequestResponseCycle.run_asgi (uvicorn/protocols/http/httptools_impl.py:420)",
         "ProxyHeadersMiddleware.__call__ (uvicorn/middleware/proxy_headers.py:60)"],
    ],
    "send": [
        [*ADMITTED, "DeploymentHandle.remote (ray/serve/handle.py:1169)", "Metric._record (ray/util/metrics.py:133)"],
        [LOOP, "RequestRouter._choose_replica_for_request (ray/serve/_private/request_router/request_router.py:1408)"],
        [*BOOT, f"UnaryUnaryCall._invoke (grpc/aio/_call.py:{GRPC_AWAIT_LINE - 7})", "serialize (grpc/_common.py:80)"],
    ],
    "reply": [
        [*ADMITTED, "within (deploy/router/body.py:18)", "DeploymentResponse.__await__ (ray/serve/handle.py:552)"],
        [*ASGI, "never_raises.<locals>.wrapper (deploy/metrics.py:40)"],
        [*ASGI, "Router._admitted_call (deploy/router/ingress.py:196)",
         "RouterProbe.verify_answered (deploy/router/probe.py:30)"],
        [LOOP, "RequestIdMiddleware.__call__.<locals>.send_with_request_id (ray/serve/_private/http_util.py:737)",
         "RequestResponseCycle.send (uvicorn/protocols/http/httptools_impl.py:522)"],
        [*BOOT, f"UnaryUnaryCall._invoke (grpc/aio/_call.py:{GRPC_AWAIT_LINE + 11})",
         "deserialize (grpc/_common.py:90)"],
    ],
    "grpc_call": [[*BOOT, f"UnaryUnaryCall._invoke (grpc/aio/_call.py:{GRPC_AWAIT_LINE})"]],
    "loop": [[LOOP], [*BOOT, "BaseEventLoop._run_once (asyncio/base_events.py:1898)"]],
    "other_thread": [["thread (5923): MainThread", "Worker.main_loop (ray/_private/worker.py:1069)"]],
}


@pytest.mark.parametrize("expected", SAMPLES)
def test_each_sample_is_put_in_its_requests_phase_by_its_stack(expected):
    for frames in SAMPLES[expected]:
        assert phase(frames) == expected, frames


def test_the_shares_split_the_grpc_call_evenly_and_leave_the_loop_and_other_threads_out():
    counts = {"before_admission": 30, "send": 20, "reply": 10, "grpc_call": 20, "loop": 500, "other_thread": 900}
    lines = [f"{';'.join(SAMPLES[k][0])} {n}" for k, n in counts.items()]
    ph = classify(lines, "test")
    assert ph.counts == counts
    assert ph.reply_share == pytest.approx((10 + 10) / 80)  # the reply and half the call, of the request's samples
    assert ph.admit_share == pytest.approx(30 / (30 + 20 + 10))  # before admission, of the samples before the reply
    assert ph.to_dict()["grpc_call_split"] == 0.5


def test_a_profile_without_request_samples_is_refused_by_name():
    with pytest.raises(ValueError, match="no request samples"):
        classify([f"{';'.join(SAMPLES['other_thread'][0])} 40", f"{LOOP} 10"], "idle.txt")
