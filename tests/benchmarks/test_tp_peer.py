"""benchmarks.tp_peer's pure parts without vLLM: the random checkpoint it writes for vLLM, the vLLM step script's
core binding, and the run's command line at TP 2."""

import json

import torch

from benchmarks.peers.vllm_step import _bind_cores, _parse_args
from benchmarks.tensor_parallel import random_weights
from benchmarks.tp_peer import checkpoint_config, write_random_checkpoint


def test_random_checkpoint_is_our_random_weights_and_loads_as_a_checkpoint(tmp_path):
    from specdec.model.checkpoint import read_weights

    out = write_random_checkpoint("small", tmp_path / "ckpt")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is False
    assert cfg == checkpoint_config("small") and cfg["hidden_size"] == 64
    ours = dict(random_weights("small").named_parameters())
    loaded = dict(read_weights(out, torch.bfloat16).named_parameters())
    assert set(loaded) == set(ours) and "lm_head.weight" in loaded  # an untied head, as our rows use
    for name, p in ours.items():
        assert torch.equal(loaded[name], p), name  # the same bits vLLM and our rows compute on


def test_bind_names_each_ranks_cores():
    args = _parse_args(["--tp", "2", "--bind", "0|1"])
    assert _bind_cores(args) == {0, 1}
    assert _bind_cores(_parse_args(["--core", "1"])) == {1}  # default: --core
    assert _bind_cores(_parse_args(["--bind", "0-2|3"])) == {0, 1, 2, 3}


def test_tp2_run_is_pinned_to_both_cores(monkeypatch, tmp_path):
    import subprocess

    import benchmarks.peers as peers

    seen = {}

    class Proc:
        def __init__(self, cmd, **kw):
            seen["cmd"], seen["env"] = cmd, kw["env"]

        def wait(self, timeout=None):
            return 1

    monkeypatch.setattr(peers, "vllm_available", lambda: True)
    monkeypatch.setattr(peers.shutil, "which", lambda name: "/usr/bin/taskset")
    monkeypatch.setattr(subprocess, "Popen", Proc)
    assert peers.run_vllm_step(256, [1, 8], 0, 5, tp=2, bind="0|1", model_dir=tmp_path) is None  # exit 1
    cmd = seen["cmd"]
    assert cmd[:3] == ["taskset", "-c", "0,1"]
    assert cmd[cmd.index("--tp") + 1] == "2" and cmd[cmd.index("--bind") + 1] == "0|1"
    assert cmd[cmd.index("--model") + 1] == str(tmp_path)
