"""``edge-agent serve`` (a subprocess, as users run it) against the real Serve app, driven by the
official ``openai`` client and LangChain's ``ChatOpenAI``: the target's output token for token."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
from ray import serve

from deploy.application import build_app
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from tests.router.test_openai_client import reference_logprobs
from tests.serve_apps import delete_app

pytestmark = pytest.mark.ray

APP, DOWN_APP = "edgeserve", "edgeserve-down"
KEY, ONE_KEY = "serve-key-12345", "serve-one-12345"
TARGET = {"model": "tiny-random", "dtype": "float32", "tokenizer": "embedded"}  # vocabulary: the tokenizer's
CHAT = [{"role": "user", "content": "Say hello"}]
PROMPT = [5, 9, 200, 31, 7, 9, 9, 44]
START_LINE = re.compile(r"serving (\S+) \(OpenAI API\) on (http://\S+)/v1:")


def cloud_args() -> dict:
    return {"target": TARGET, "pacing": {"round_overhead_ms": 0},  # trees pay on the tiny target: exercise them
            "router": {"tenants": [{"name": "serve", "api_key": KEY, "max_sessions": 8},
                                   {"name": "one", "api_key": ONE_KEY, "max_sessions": 1}]}}


def deploy_cloud(name: str, port: int) -> str:
    serve.run(build_app(cloud_args()), name=name, route_prefix=f"/{name}")
    return f"http://127.0.0.1:{port}/{name}"


class EdgeProcess:
    """``edge-agent serve --port 0`` in a subprocess; ``url`` from its start-up line."""

    def __init__(self, cloud: str, key: str, *extra: str):
        cmd = [sys.executable, "-m", "edge_agent", "serve", "--server", cloud, "--api-key", key, "--port", "0",
               "--draft", "tiny-random", "--dtype", "float32", *extra]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.lines: list[str] = []
        self._started = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._started.wait(180) or not hasattr(self, "start_line"):
            self.stop()
            raise AssertionError(f"edge-agent serve did not start: {''.join(self.lines)}")
        m = START_LINE.search(self.start_line)
        self.model, self.url = m.group(1), m.group(2)

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if START_LINE.search(line):
                self.start_line = line
                self._started.set()
        self._started.set()

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused-locally", max_retries=0, timeout=120, **kw)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@pytest.fixture(scope="module")
def cloud(ray_session):
    yield deploy_cloud(APP, ray_session["http_port"])
    delete_app(APP)


@pytest.fixture(scope="module")
def edge(cloud):
    p = EdgeProcess(cloud, KEY)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def target():
    from deploy.config import ModelConfig
    from specdec.model.loading import load_model

    lm = load_model(TARGET["model"], dtype="float32", tokenizer=TARGET["tokenizer"], seed=ModelConfig(**TARGET).seed)
    return lm.model, lm.tokenizer


def chat_ids(tok) -> list[int]:
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


GREEDY = dict(temperature=0, max_tokens=16, extra_body={"ignore_eos": True})


def test_start_up_line_health_models_and_metrics(edge, cloud):
    assert edge.url.startswith("http://127.0.0.1:")  # loopback by default
    assert "tiny-random" in edge.start_line and cloud in edge.start_line
    h = edge.health()
    assert h["status"] == "ok" and h["model"] == edge.model
    with edge.client() as c:
        assert [m.id for m in c.models.list().data] == [edge.model]
    assert "specedge_edge_serve_requests_running" in httpx.get(edge.url + "/metrics", timeout=10).text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_and_completions_are_the_targets_greedy_output(edge, target, stream):
    model, tok = target
    want_chat = reference_decode(model, chat_ids(tok), SamplingParams(max_tokens=16, ignore_eos=True))
    want_cmpl = reference_decode(model, PROMPT, SamplingParams(max_tokens=16, ignore_eos=True))
    with edge.client() as c:
        if stream:
            chunks = list(c.chat.completions.create(model=edge.model, messages=CHAT, stream=True, **GREEDY))
            assert chunks[0].choices[0].delta.role == "assistant"
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == tok.decode(want_chat,
                                                                                             skip_special_tokens=True)
            text = "".join(ch.choices[0].text for ch in c.completions.create(model=edge.model, prompt=PROMPT,
                                                                               stream=True, **GREEDY))
            assert text == tok.decode(want_cmpl, skip_special_tokens=True)
        else:
            r = c.chat.completions.create(model=edge.model, messages=CHAT, **GREEDY)
            assert r.model_extra["specedge"]["token_ids"] == want_chat and r.usage.completion_tokens == 16
            assert r.model_extra["specedge"]["rounds"] >= 1  # drafted here, verified by the cloud
            r = c.completions.create(model=edge.model, prompt=PROMPT, **GREEDY)
            assert r.model_extra["specedge"]["token_ids"] == want_cmpl


def test_langchain_chat_openai(edge, target):
    from langchain_openai import ChatOpenAI

    model, tok = target
    want = tok.decode(reference_decode(model, chat_ids(tok), SamplingParams(max_tokens=12, ignore_eos=True)),
                      skip_special_tokens=True)
    llm = ChatOpenAI(base_url=edge.url + "/v1", api_key="unused-locally", model=edge.model, temperature=0,
                     max_tokens=12, max_retries=0, extra_body={"ignore_eos": True})
    assert llm.invoke([("user", "Say hello")]).content == want
    assert "".join(chunk.content for chunk in llm.stream([("user", "Say hello")])) == want


def test_a_seeded_sample_repeats_and_is_the_clouds_own(edge, cloud):
    args = dict(model=edge.model, prompt=PROMPT, temperature=1.0, seed=7, max_tokens=20,
                extra_body={"ignore_eos": True})
    with edge.client() as c:
        a, b = (c.completions.create(**args).model_extra["specedge"]["token_ids"] for _ in range(2))
    with openai.OpenAI(base_url=cloud + "/v1", api_key=KEY, max_retries=0, timeout=120) as cc:
        server_only = cc.completions.create(**args).model_extra["specedge"]["token_ids"]
    assert a == b == server_only and len(a) == 20  # one uniform per token: the same sample path


def test_logprobs_are_the_targets(edge, target):
    model, tok = target
    with edge.client() as c:
        r = c.chat.completions.create(model=edge.model, messages=CHAT, logprobs=True, top_logprobs=2, **GREEDY)
    ids = r.model_extra["specedge"]["token_ids"]
    ref = reference_logprobs(model, chat_ids(tok), ids)
    content = r.choices[0].logprobs.content
    assert len(content) == len(ids) == 16
    assert torch.allclose(torch.tensor([x.logprob for x in content]), ref[range(len(ids)), ids], atol=1e-4)
    assert all(len(x.top_logprobs) == 2 for x in content)


def test_penalised_greedy_output_is_penalised_target_decoding(edge, target):
    model, _tok = target
    pen = dict(presence_penalty=-2.0, frequency_penalty=-1.0)  # a flat random target: pull towards repeats
    want = reference_decode(model, PROMPT, SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=0.5,
                                                          **pen))
    assert want != reference_decode(model, PROMPT, SamplingParams(max_tokens=16, ignore_eos=True))
    with edge.client() as c:
        r = c.completions.create(model=edge.model, prompt=PROMPT, temperature=0, max_tokens=16, **pen,
                                 extra_body={"repetition_penalty": 0.5, "ignore_eos": True})
    assert r.model_extra["specedge"]["token_ids"] == want


def test_two_concurrent_clients_share_one_draft(edge, target):
    model, tok = target
    want = tok.decode(reference_decode(model, PROMPT, SamplingParams(max_tokens=40, ignore_eos=True)),
                      skip_special_tokens=True)
    out: list = [None, None]
    in_flight = threading.Barrier(2)

    def run(i: int) -> None:
        with edge.client() as c:
            stream = c.completions.create(model=edge.model, prompt=PROMPT, stream=True, temperature=0, max_tokens=40,
                                          extra_body={"ignore_eos": True})
            parts = [next(iter(stream)).choices[0].text]
            in_flight.wait(60)  # both generations are under way at once
            parts += [ch.choices[0].text for ch in stream]
            out[i] = "".join(parts)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert out == [want, want]
    h = edge.health()
    assert h["agents"] >= 2 and h["draft_models"] == 1 and h["draft_executors"] == 1 and h["running"] == 0


def cloud_sessions(cloud: str, key: str = KEY) -> int:
    return httpx.get(cloud + "/v1/stats", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()["sessions"]


def test_a_client_that_drops_mid_stream_leaves_no_cloud_session(edge, cloud):
    assert cloud_sessions(cloud) == 0
    with edge.client() as c:
        stream = c.completions.create(model=edge.model, prompt=PROMPT, stream=True, temperature=0, max_tokens=1500,
                                      extra_body={"ignore_eos": True})
        next(iter(stream))
        assert cloud_sessions(cloud) == 1
        stream.close()  # the client goes away mid-generation
    deadline = time.monotonic() + 30  # a bound on a leak, not a timing: the loaded CI needed more than 5 s
    while cloud_sessions(cloud) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cloud_sessions(cloud) == 0
    deadline = time.monotonic() + 30  # a bound on a leak, not a timing: the loaded CI needed more than 5 s
    while edge.health()["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert edge.health()["running"] == 0


def test_a_client_that_gives_up_on_a_whole_response_leaves_no_cloud_session(edge, cloud):
    body = {"model": edge.model, "prompt": PROMPT, "temperature": 0, "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client drops the connection while the generation runs
        httpx.post(edge.url + "/v1/completions", json=body, timeout=2.0)
    deadline = time.monotonic() + 30  # a bound on a leak, not a timing: the loaded CI needed more than 5 s
    while (cloud_sessions(cloud) or edge.health()["running"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cloud_sessions(cloud) == 0 and edge.health()["running"] == 0


def test_structured_output_with_openais_parse_and_langchains_with_structured_output(edge):
    """Issue 63 at the edge's local server: a pydantic model through the official client's
    ``chat.completions.parse`` and LangChain's ``with_structured_output`` (json_schema), the edge
    drafting with its own grammar matcher and the cloud masking every node."""
    from typing import Literal

    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Verdict(BaseModel):
        answer: Literal["yes", "no"]
        confident: bool

    with edge.client() as c:
        parsed = c.chat.completions.parse(model=edge.model, messages=CHAT, temperature=0, max_tokens=40,
                                          response_format=Verdict).choices[0].message.parsed
    assert isinstance(parsed, Verdict)
    llm = ChatOpenAI(base_url=edge.url + "/v1", api_key="unused-locally", model=edge.model, temperature=0,
                     max_tokens=40, max_retries=0)
    out = llm.with_structured_output(Verdict, method="json_schema").invoke([("user", "Is the sky blue?")])
    assert isinstance(out, Verdict)


def test_ignored_and_unsupported_fields(edge):
    body = {"model": edge.model, "prompt": PROMPT, "max_tokens": 2, "frobnicate": 1}
    r = httpx.post(edge.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "frobnicate"
    r = httpx.post(edge.url + "/v1/chat/completions", json={"messages": CHAT, "logit_bias": {"5": 1}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    with edge.client() as c, pytest.raises(openai.BadRequestError):
        c.completions.create(model=edge.model, prompt=PROMPT, max_tokens=2, presence_penalty=9)


@pytest.mark.exclusive  # answers timed in seconds
def test_cloud_shedding_and_a_stopped_cloud_give_openai_errors_then_sigterm_stops_it(ray_session):
    """A tenant allowed one session: a second request is the cloud's 429, at once; the cloud app
    deleted: an OpenAI error (503 cloud_unavailable) within seconds, never a hang; SIGTERM: a clean exit."""
    down = deploy_cloud(DOWN_APP, ray_session["http_port"])
    p = EdgeProcess(down, ONE_KEY)
    try:
        with p.client() as c:
            stream = c.completions.create(model=p.model, prompt=PROMPT, stream=True, temperature=0, max_tokens=1500,
                                          extra_body={"ignore_eos": True})
            next(iter(stream))
            t0 = time.monotonic()
            with pytest.raises(openai.RateLimitError) as e:
                c.completions.create(model=p.model, prompt=PROMPT, max_tokens=4)
            assert time.monotonic() - t0 < 5 and e.value.response.headers.get("retry-after")
            stream.close()
            serve.delete(DOWN_APP)  # the cloud goes away
            t0 = time.monotonic()
            with pytest.raises(openai.APIStatusError) as e:
                c.completions.create(model=p.model, prompt=PROMPT, max_tokens=4)
            assert e.value.status_code == 503 and e.value.body["code"] == "cloud_unavailable"
            assert time.monotonic() - t0 < 10
    finally:
        rc = p.stop()
    assert rc == 0 and any("stopped" in line for line in p.lines), "".join(p.lines)


def test_tool_calls_through_the_official_client_and_langchain(edge):
    """Issue 63's tools at the edge's local server: the same flows as at the cloud, the edge drafting calls
    with its own grammar matcher."""
    from tests.router.test_openai_client import check_tool_flows

    with edge.client() as c:
        check_tool_flows(c, edge.model)
