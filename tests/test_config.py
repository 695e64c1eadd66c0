"""Configuration: defaults, validation of bad values, tenant key hashing, duplicates, YAML files."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from deploy.config import (DEV_API_KEY, AppConfig, ModelConfig, PacingConfig, RouterConfig, ServerDraftConfig,
                           TenantConfig, VerifierConfig, hash_api_key)

REPO = Path(__file__).resolve().parents[1]


def test_defaults_are_valid_and_documented():
    c = AppConfig()
    assert c.target.model == "embedded" and c.target.dtype == "auto"
    assert c.verifier.max_tree_nodes == 64 and c.verifier.pipeline_parallel_size == 1
    assert c.route_prefix == "/"
    # a round trip through a plain dict (what `serve run` passes as args) is lossless
    assert AppConfig(**c.model_dump()) == c
    for model in (ModelConfig, VerifierConfig, RouterConfig, PacingConfig, TenantConfig):
        assert model.model_fields, model


@pytest.mark.parametrize("section, values", [
    ("target", {"dtype": "float64"}),
    ("target", {"device": "tpu"}),
    ("target", {"attn_implementation": "flash"}),
    ("target", {"attn_implementation": "flash_attention_2"}),  # ignores tree masks (issue 14)
    ("target", {"max_model_len": 8}),
    ("verifier", {"num_replicas": 0}),
    ("verifier", {"max_batch_sessions": 0}),
    ("verifier", {"max_batch_sessions": 5000}),
    ("verifier", {"batch_wait_ms": -1}),
    ("verifier", {"max_tree_nodes": 0}),
    ("verifier", {"max_tree_depth": 2000}),
    ("verifier", {"kv_budget_tokens": 10}),
    ("verifier", {"idle_timeout_s": 0}),
    ("verifier", {"pipeline_parallel_size": 0}),
    ("verifier", {"chain_top_k": 0}),
    ("verifier", {"max_batch_sessions": "many"}),
    ("verifier", {"unknown_knob": 1}),  # typos are errors, not silently ignored
    ("router", {"max_body_bytes": 100}),
    ("router", {"retry_after_s": 0}),
    ("pacing", {"min_depth": 0}),
    ("pacing", {"ema": 0}),
    ("pacing", {"ema": 1.5}),
    ("server_draft", {"depth": 0}),
    ("server_draft", {"depth": 33}),
])
def test_bad_values_are_rejected(section, values):
    with pytest.raises(ValidationError):
        AppConfig(**{section: values})


def test_unknown_top_level_key_is_rejected():
    with pytest.raises(ValidationError):
        AppConfig(targets={})


def test_plain_api_keys_are_hashed_and_dropped():
    t = TenantConfig(name="acme", api_key="a-long-secret")
    assert t.api_key is None
    assert t.api_key_sha256 == hashlib.sha256(b"a-long-secret").hexdigest() == hash_api_key("a-long-secret")
    assert "a-long-secret" not in t.model_dump_json()
    h = hash_api_key("other-secret")
    assert TenantConfig(name="b", api_key_sha256=h).api_key_sha256 == h


@pytest.mark.parametrize("kwargs", [
    {"name": "acme"},  # no key at all
    {"name": "acme", "api_key": "a-long-secret", "api_key_sha256": "0" * 64},  # both
    {"name": "acme", "api_key": "short"},
    {"name": "acme", "api_key_sha256": "xyz"},
    {"name": "acme", "api_key_sha256": "A" * 64},  # hex digests are lower case
    {"name": "", "api_key": "a-long-secret"},
    {"name": "bad name", "api_key": "a-long-secret"},
    {"name": "x" * 65, "api_key": "a-long-secret"},
    {"name": "acme", "api_key": "a-long-secret", "weight": 0},
    {"name": "acme", "api_key": "a-long-secret", "max_sessions": 0},
    {"name": "acme", "api_key": "a-long-secret", "tokens_per_second": -1},
])
def test_bad_tenants_are_rejected(kwargs):
    with pytest.raises(ValidationError):
        TenantConfig(**kwargs)


def test_duplicate_tenant_names_are_rejected():
    with pytest.raises(ValidationError, match="unique"):
        RouterConfig(tenants=[{"name": "a", "api_key": "key-one-xx"}, {"name": "a", "api_key": "key-two-xx"}])


def test_tenants_file_and_dev_fallback(tmp_path):
    assert [(t.name, t.api_key_sha256) for t in RouterConfig().load_tenants()] == [("dev", hash_api_key(DEV_API_KEY))]
    f = tmp_path / "tenants.yaml"
    f.write_text(yaml.safe_dump({"tenants": [{"name": "file-tenant", "api_key": "file-secret-1", "weight": 2}]}))
    r = RouterConfig(tenants_file=str(f), tenants=[{"name": "inline", "api_key": "inline-secret"}])
    tenants = r.load_tenants()
    assert [t.name for t in tenants] == ["inline", "file-tenant"]
    assert tenants[1].weight == 2 and tenants[1].api_key is None
    f.write_text(yaml.safe_dump({"tenants": [{"name": "bad", "api_key": "x"}]}))
    with pytest.raises(ValidationError):
        RouterConfig(tenants_file=str(f)).load_tenants()


def test_from_yaml(tmp_path):
    f = tmp_path / "app.yaml"
    f.write_text(yaml.safe_dump({"target": {"model": "tiny-random", "dtype": "float32"},
                                 "verifier": {"max_tree_nodes": 32}}))
    c = AppConfig.from_yaml(f)
    assert c.target.model == "tiny-random" and c.verifier.max_tree_nodes == 32
    f.write_text("")
    assert AppConfig.from_yaml(f) == AppConfig()
    f.write_text(yaml.safe_dump({"verifier": {"max_tree_nodes": -1}}))
    with pytest.raises(ValidationError):
        AppConfig.from_yaml(f)


def test_shipped_serve_config_validates():
    """`serve run deploy/config.yaml`: every application's args are a valid AppConfig."""
    path = REPO / "deploy" / "config.yaml"
    if not path.exists():
        pytest.skip("deploy/config.yaml not present in this checkout")
    data = yaml.safe_load(path.read_text())
    apps = data["applications"]
    assert apps and all(a["import_path"] == "deploy:build_app" for a in apps)
    for app in apps:
        AppConfig(**(app.get("args") or {}))


def test_server_draft_model_is_a_model_config():
    c = ServerDraftConfig(model={"model": "tiny-random", "seed": 3})
    assert isinstance(c.model, ModelConfig) and c.model.seed == 3
    with pytest.raises(ValidationError):
        ServerDraftConfig(model={"model": "x", "bogus": 1})


def test_tenant_names_and_keys_unique_across_file_and_inline(tmp_path):
    from deploy.config import RouterConfig

    f = tmp_path / "tenants.yaml"
    f.write_text(yaml.safe_dump({"tenants": [{"name": "a", "api_key": "file-key-0001"}]}))
    with pytest.raises(ValueError, match="unique"):
        RouterConfig(tenants=[{"name": "a", "api_key": "inline-key-01"}], tenants_file=str(f)).load_tenants()
    with pytest.raises(ValueError, match="API key"):
        RouterConfig(tenants=[{"name": "b", "api_key": "file-key-0001"}], tenants_file=str(f)).load_tenants()
    with pytest.raises(ValidationError):
        RouterConfig(tenants=[{"name": "x", "api_key": "same-key-0001"}, {"name": "y", "api_key": "same-key-0001"}])


@pytest.mark.parametrize("pacing", [{"min_depth": 5, "max_depth": 3}, {"default_depth": 20},
                                    {"tree_budgets": [-1, 8]}, {"tree_budgets": [32, 8]}, {"tree_budgets": []}])
def test_pacing_ranges(pacing):
    with pytest.raises(ValidationError):
        AppConfig(pacing=pacing)


@pytest.mark.parametrize("early", [{"enabled": True, "heads": "untrained"}, {"layers": [0]}, {"layers": [3, 3]},
                                   {"layers": []}, {"enabled": "maybe"}, {"heads_path": "x"}])
def test_early_exit_config_is_validated(early):
    """Issue 19: exit layers are distinct layer counts >= 1; untrained heads need them."""
    with pytest.raises(ValidationError):
        AppConfig(verifier={"early_exit": early})


def test_early_exit_with_one_process_or_pipeline_stages():
    ok = AppConfig(verifier={"early_exit": {"enabled": True, "heads": "untrained", "layers": [1, 2]}})
    assert ok.verifier.early_exit.layers == [1, 2] and not AppConfig().verifier.early_exit.enabled
    pp = AppConfig(verifier={"pipeline_parallel_size": 2, "early_exit": {"enabled": True}})  # stages run the exits
    assert pp.verifier.early_exit.enabled and pp.verifier.pipeline_parallel_size == 2


@pytest.mark.parametrize("adapters, match", [
    ({"": "a/b"}, "version name"),
    ({"-code": "a/b"}, "version name"),  # a letter or digit first
    ({"co de": "a/b"}, "version name"),
    ({"x" * 65: "a/b"}, "version name"),
    ({"code": ""}, "empty adapter path"),
    ({"embedded": "a/b"}, "base model's name"),  # the base's configured name
    ({"base": "a/b"}, "base model's name"),  # what a request says for the base
])
def test_target_versions_are_validated(adapters, match):
    with pytest.raises(ValidationError, match=match):
        AppConfig(target={"adapters": adapters})


def test_target_versions_names_and_pipeline_refusal():
    ok = AppConfig(target={"adapters": {"code": "a/b", "v1.2:tenant_x-y": "c/d"}, "max_loaded_adapters": 1})
    assert sorted(ok.target.adapters) == ["code", "v1.2:tenant_x-y"]
    with pytest.raises(ValidationError):
        AppConfig(target={"max_loaded_adapters": 0})
    with pytest.raises(ValidationError, match="pipeline_parallel_size 1"):
        AppConfig(target={"adapters": {"code": "a/b"}}, verifier={"pipeline_parallel_size": 2})
    assert AppConfig(verifier={"pipeline_parallel_size": 2}).target.adapters == {}  # the base alone is fine
    with pytest.raises(ValidationError, match="adapters are for the target only"):
        AppConfig(server_draft={"model": {"model": "tiny-random", "adapters": {"code": "a/b"}}})


def test_versions_user_config_is_validated_like_the_app_config():
    """A Serve user_config update (deploy.application.versions_user_config's shape) goes through
    the same model: the base's names, pipeline stages, and 'adapters' must be present."""
    from deploy.application import versions_user_config
    from deploy.config import versions_update

    cfg = AppConfig(target={"adapters": {"code": "a/b"}, "max_loaded_adapters": 2})
    assert versions_update(cfg, versions_user_config(cfg)) == cfg  # the round trip changes nothing
    new = versions_update(cfg, {"adapters": {"code": "a/b", "docs": "c/d"}})
    assert new.target.adapters == {"code": "a/b", "docs": "c/d"} and new.target.max_loaded_adapters == 2
    assert versions_update(cfg, {"adapters": {}}).target.adapters == {}  # removing every version is explicit
    for bad, match in [({}, "needs an 'adapters'"), ({"max_loaded_adapters": 3}, "needs an 'adapters'"),
                       (None, "needs an 'adapters'"), ({"adapters": {}, "models": {}}, "unknown keys"),
                       ({"adapters": {"base": "x"}}, "base model's name"), ({"adapters": {"a b": "x"}}, "version name"),
                       ({"adapters": {"code": "x"}, "max_loaded_adapters": 0}, "greater than or equal")]:
        with pytest.raises(ValueError, match=match):
            versions_update(cfg, bad)
    pp = AppConfig(verifier={"pipeline_parallel_size": 2})
    with pytest.raises(ValueError, match="pipeline_parallel_size 1"):
        versions_update(pp, {"adapters": {"code": "a/b"}})


@pytest.mark.parametrize("args", [{"verifier": {"num_replicas": 2}}, {"router": {"num_replicas": 2}},
                                  {"verifier": {"pipeline_parallel_size": 2}}])
def test_colocated_topology_is_one_replica_of_one_stage(args):
    AppConfig(topology="colocated")
    AppConfig(topology="split", **args)
    with pytest.raises(ValidationError, match="topology colocated"):
        AppConfig(topology="colocated", **args)
    with pytest.raises(ValidationError):
        AppConfig(topology="fused")


def test_colocated_app_is_the_router_alone_with_the_verifiers_resources():
    from deploy.application import build_app, verifier_deployment

    app = build_app({"topology": "colocated", "verifier": {"num_cpus": 2, "num_gpus_per_stage": 0.5}})
    d = app._bound_deployment
    assert d.name == "Router" and d.ray_actor_options["num_cpus"] == 2 and d.ray_actor_options["num_gpus"] == 0.5
    assert app._bound_deployment.init_args[0] is None  # no verifier handle: it builds its own
    assert verifier_deployment(AppConfig(topology="colocated")) == "Router"
    assert verifier_deployment(AppConfig()) == "Verifier"


# -- resource wiring (issue 53): each mistake refused at validation, before any weights load ----------
def _checkpoint(tmp_path, **over) -> str:
    import json

    cfg = dict(model_type="llama", num_hidden_layers=4, hidden_size=64, num_attention_heads=4, intermediate_size=128,
               vocab_size=512, max_position_embeddings=2048, **over)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)  # no weights at all: validation must not need them


@pytest.mark.parametrize("args, message", [
    ({"target": {"device": "cuda"}}, "target.device cuda needs verifier.num_gpus_per_stage > 0"),
    ({"target": {"device": "cuda"}, "verifier": {"num_gpus_per_stage": 1},
      "server_draft": {"model": {"model": "embedded", "device": "cuda"}}}, "runs in the Router deployment"),
    ({"server_draft": {"model": {"model": "embedded", "device": "cuda"}}, "topology": "colocated"},
     "runs in the Router deployment"),  # colocated, but no GPU reserved
    ({"target": {"model": "tiny-random", "tiny_config": {"num_layers": 3}}, "verifier": {"pipeline_parallel_size": 4}},
     "pipeline_parallel_size 4 is more stages than the target's 3 layers"),
    ({"target": {"model": "embedded", "max_model_len": 8193}}, "max_model_len 8193 is beyond the checkpoint's "
                                                               "context (max_position_embeddings 8192)"),
    ({"verifier": {"pipeline_parallel_size": 2, "kv_budget_tokens": None}}, "needs verifier.kv_budget_tokens"),
    ({"verifier": {"gpu_memory_utilization": 0}}, "gpu_memory_utilization"),
    ({"verifier": {"gpu_memory_utilization": 1.5}}, "gpu_memory_utilization"),
])
def test_each_wiring_mistake_is_refused(args, message):
    import re

    with pytest.raises(ValidationError, match=re.escape(message)):
        AppConfig(**args)


def test_wiring_that_is_right_passes():
    AppConfig(target={"device": "cuda"}, verifier={"num_gpus_per_stage": 1})
    AppConfig(target={"device": "cuda"}, verifier={"num_gpus_per_stage": 1}, topology="colocated",
              server_draft={"model": {"model": "embedded", "device": "cuda"}})
    AppConfig(server_draft={"enabled": False, "model": {"model": "embedded", "device": "cuda"}})
    AppConfig(target={"model": "tiny-random", "tiny_config": {"num_layers": 3}}, verifier={"pipeline_parallel_size": 3})
    AppConfig(target={"model": "embedded", "max_model_len": 8192})
    assert AppConfig(verifier={"kv_budget_tokens": None}).verifier.kv_budget_tokens is None


def test_a_local_checkpoint_is_checked_from_its_config_json(tmp_path):
    path = _checkpoint(tmp_path)
    AppConfig(target={"model": path, "max_model_len": 2048}, verifier={"pipeline_parallel_size": 4})
    with pytest.raises(ValidationError, match="5 is more stages than the target's 4 layers"):
        AppConfig(target={"model": path}, verifier={"pipeline_parallel_size": 5})
    with pytest.raises(ValidationError, match="max_model_len 4096 is beyond the checkpoint's context"):
        AppConfig(target={"model": path, "max_model_len": 4096})


def test_a_checkpoint_without_a_context_gets_its_familys(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="qwen3", num_hidden_layers=2)))
    with pytest.raises(ValidationError, match="max_position_embeddings 32768"):
        AppConfig(target={"model": str(tmp_path), "max_model_len": 40000})


def test_the_gpu_quickstart_config_validates():
    app = yaml.safe_load((REPO / "deploy" / "config-gpu.yaml").read_text())["applications"][0]
    cfg = AppConfig(**app["args"])
    assert cfg.target.device == "cuda" and cfg.verifier.num_gpus_per_stage == 1
    assert cfg.verifier.kv_budget_tokens is None and cfg.verifier.gpu_memory_utilization == 0.9


def test_verifier_replicas_spread_one_per_node():
    """verifier.max_replicas_per_node reaches Serve's deployment options (tests/loadtests/test_cluster_faults.py
    runs it on three nodes); Serve refuses it beside a placement group, so pipeline stages refuse it here."""
    from deploy.application import verifier_options

    assert "max_replicas_per_node" not in verifier_options(AppConfig())
    assert verifier_options(AppConfig(verifier={"max_replicas_per_node": 1}))["max_replicas_per_node"] == 1
    with pytest.raises(ValidationError, match="max_replicas_per_node needs verifier.pipeline_parallel_size 1"):
        AppConfig(verifier={"max_replicas_per_node": 1, "pipeline_parallel_size": 2})
    with pytest.raises(ValidationError):
        AppConfig(verifier={"max_replicas_per_node": 0})
