"""Target versions in the real Serve app, deployed from a Serve config (as `serve deploy` / KubeRay
do): config updates that change only the deployments' ``user_config`` add a version, then remove
one, through ``reconfigure``, with no restart. An added version serves sessions and OpenAI
completions (``model: "<version>"``; ``"base"`` names the base, as in an open request) with its
own output; sessions of the base and of the kept version go on exactly (same replica, same KV);
the removed version's session answers 404 ``model_not_found``, and so does an open of it;
``GET /v1/models`` lists what is served."""

from __future__ import annotations

import time

import httpx
import pytest
from ray import serve
from ray.serve.schema import ApplicationStatus, ServeDeploySchema

from specdec.protocol import ReplyFrame, VerifyFrame
from specdec.model.loading import load_model
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from tests.specdec.model.test_lora import ALL, make_adapter, merged
from tests.serve_apps import delete_app

pytestmark = pytest.mark.ray
pytest.importorskip("peft")
AUTH = {"Authorization": "Bearer specedge-dev-key"}
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
PROMPT = [5, 17, 99, 4, 250, 31]


def versions_config(initial: dict, adapters: dict, topology: str = "split") -> ServeDeploySchema:
    """``initial``: target.adapters of the app's args (fixed); ``adapters``: the versions served now.
    ``colocated``: the Router deployment alone, its replica holding the verifier."""
    versions = {"adapters": adapters, "max_loaded_adapters": 1}
    names = ["Router"] if topology == "colocated" else ["Verifier", "Router"]
    return ServeDeploySchema(applications=[{
        "name": f"versions-{topology}", "route_prefix": f"/versions-{topology}",
        "import_path": "deploy.application:build_app",
        "args": {"target": {"model": "tiny-random", "dtype": "float32", "adapters": initial,
                            "max_loaded_adapters": 1},
                 "verifier": {"torch_threads": 1, "num_cpus": 0}, "access_log": False, "topology": topology},
        # the no-restart path: only user_config changes between deploys (args stay as first deployed)
        "deployments": [{"name": n, "user_config": versions} for n in names],
    }])


def deploy(client, config: ServeDeploySchema, timeout_s: float = 300.0) -> None:
    """``serve deploy`` the config and wait until its app runs. Ray's own ``_blocking`` gives up after
    a fixed 60 s, which a loaded 2-core CI machine exceeded while starting replicas (not a failure
    of the app); a failed deploy still fails at once, with Serve's message."""
    client.deploy_apps(config)
    (name,) = [app.name for app in config.applications]
    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(name)
        if app is not None and app.status == ApplicationStatus.RUNNING:
            return
        if app is not None and app.status == ApplicationStatus.DEPLOY_FAILED:
            raise AssertionError(f"deploy of {name} failed: {app.message}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} not running after {timeout_s:.0f} s: {app}")
        time.sleep(0.2)


@pytest.mark.parametrize("topology", ["split", "colocated"])
def test_config_updates_add_then_remove_a_version_without_a_restart(ray_session, tmp_path, topology):
    base = load_model("tiny-random", dtype="float32", seed=0).model
    paths = {"code": make_adapter(base, tmp_path / "code", 21, ALL),
             "chat": make_adapter(base, tmp_path / "chat", 22, ["q_proj", "v_proj"], r=8)}
    client = serve.context._get_global_client()

    deploy(client, versions_config(paths, {"code": paths["code"]}, topology))
    url = f"http://127.0.0.1:{ray_session['http_port']}/versions-{topology}"
    try:
        with httpx.Client(base_url=url, timeout=60, headers=AUTH) as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]][1:] == ["code"]
            r = c.post("/v1/sessions", json={"prompt_ids": PROMPT, "model": "chat"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            up0, t0 = c.get("/v1/stats").json()["uptime_seconds"], time.time()
            deploy(client, versions_config(paths, paths, topology))  # adds "chat"
            sessions, out = {}, {}
            for v in ("code", "chat", None):
                deadline = time.time() + 60
                while True:  # until the replica's reconfigure has run
                    r = c.post("/v1/sessions", json={"prompt_ids": PROMPT, "model": v, "sampling": GREEDY.to_dict()})
                    if r.status_code != 404 or time.time() > deadline:
                        break
                    time.sleep(0.5)
                assert r.status_code == 200, r.text
                sessions[v] = r.json()
                out[v] = [r.json()["first_token"]]
            assert [m["id"] for m in c.get("/v1/models").json()["data"]][1:] == ["chat", "code"]
            completions = {}
            for model in ("chat", "base"):  # OpenAI's model field: a version, or "base"
                r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                                    "model": model})
                assert r.status_code == 200, r.text
                completions[model] = r.json()
            r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "model": "nope"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

            def step(v) -> httpx.Response:
                s = sessions[v]
                r = c.post(f"/v1/sessions/{s['session_id']}/verify", content=VerifyFrame(s["prefix_len"], [], []).encode())
                if r.status_code == 200:
                    reply = ReplyFrame.decode(r.content)
                    s["prefix_len"] = reply.prefix_len
                    out[v].append(reply.bonus)
                return r

            for _ in range(4):
                for v in sessions:
                    assert step(v).status_code == 200
            deploy(client, versions_config(paths, {"code": paths["code"]}, topology))  # removes "chat"
            deadline = time.time() + 60
            while "chat" in [m["id"] for m in c.get("/v1/models").json()["data"]] and time.time() < deadline:
                time.sleep(0.5)
            r = step("chat")
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
            r = c.post("/v1/sessions", json={"prompt_ids": PROMPT, "model": "chat"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            while len(out["code"]) < GREEDY.max_tokens:  # the same replica and KV: no restart
                assert step("code").status_code == 200
                assert step(None).status_code == 200
            assert c.get("/v1/stats").json()["uptime_seconds"] >= up0 + time.time() - t0 - 1.0  # not restarted
    finally:
        delete_app(f"versions-{topology}")
    refs = {"code": merged(base, paths["code"]), "chat": merged(base, paths["chat"]), None: base}
    assert out["code"] == reference_decode(refs["code"], PROMPT, GREEDY)
    assert out[None] == reference_decode(base, PROMPT, GREEDY)
    assert out["chat"] == reference_decode(refs["chat"], PROMPT, GREEDY)[: len(out["chat"])]
    plain = SamplingParams(max_tokens=12)  # the completions' sampling: temperature 0, EOS honoured
    assert completions["chat"]["specedge"]["token_ids"] == reference_decode(refs["chat"], PROMPT, plain)
    assert completions["chat"]["model"] == "chat"
    assert completions["base"]["specedge"]["token_ids"] == reference_decode(base, PROMPT, plain)
    assert completions["chat"]["specedge"]["token_ids"] != completions["base"]["specedge"]["token_ids"]
