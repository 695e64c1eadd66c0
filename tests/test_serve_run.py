"""`serve run deploy.app` from a shell: the whole cloud side on the embedded target, no arguments."""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from benchmarks.child_group import start_healthy, stop_group
from deploy.application import build_app
from deploy.config import AppConfig
from specdec.protocol import ReplyFrame, VerifyFrame

REPO = Path(__file__).resolve().parents[1]
SERVE = str(Path(sys.executable).with_name("serve"))


def test_config_yaml_is_a_valid_serve_config():
    from ray.serve.schema import ServeDeploySchema

    data = yaml.safe_load((REPO / "deploy" / "config.yaml").read_text())
    ServeDeploySchema(**data)
    (app,) = data["applications"]
    AppConfig(**app["args"])
    assert app["import_path"] == "deploy:build_app"
    build_app(app["args"])  # binds without starting anything


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.slow
@pytest.mark.ray
def test_serve_run_deploy_app_subprocess(tmp_path):
    if not _port_free(8000):
        pytest.fail("port 8000 is taken: `serve run deploy.app` serves there; stop whatever uses it")
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0", RAY_worker_niceness="0",
               PYTHONPATH=str(REPO),  # as the demo runs it
               RAY_ADDRESS="local")  # a Ray of its own, never one a /tmp/ray/ray_current_cluster names (a stale one)
    base = "http://127.0.0.1:8000"
    # once more when Ray's node timed out starting (benchmarks/child_group.py)
    proc, _ = start_healthy([SERVE, "run", "deploy.app"], base, (tmp_path / "serve-1.log", tmp_path / "serve-2.log"),
                            240, env, cwd=REPO, poll_s=1)
    try:
        h = {"Authorization": "Bearer specedge-dev-key"}
        with httpx.Client(base_url=base, headers=h, timeout=120) as c:
            info = c.get("/v1/model").json()
            assert info["model"] == "SmolLM2-135M-Instruct" and info["vocab_size"] == 49152
            d = c.post("/v1/sessions", json={"prompt_ids": [1, 504, 3458, 314, 253], "sampling": {"max_tokens": 6}})
            assert d.status_code == 200, d.text
            d = d.json()
            n, done = d["prefix_len"], d["finished"]
            while not done:  # plain decoding rounds (empty trees) until max_tokens
                rep = ReplyFrame.decode(c.post(f"/v1/sessions/{d['session_id']}/verify",
                                               content=VerifyFrame(n, [], []).encode()).content)
                n, done = rep.prefix_len, rep.finished
            assert n == 5 + 6
            r = c.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 5,
                                                "temperature": 0})
            assert r.status_code == 200 and r.json()["choices"][0]["text"].strip()
    finally:
        stop_group(proc, signal.SIGINT, whole_group=True)  # serve run and the Ray it started
