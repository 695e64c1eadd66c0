"""benchmarks.full_size at the small shape on CPU: the checkpoint it writes, the replica's loading path
with memory-based sizing, edge agents batched in one forward, greedy equality with one-token decoding."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from benchmarks import full_size
from specdec.model.loading import load_weights

ARGS = ["--shape", "small", "--draft", "self", "--max-tokens", "12", "--prompt-len", "24",
        "--gpu-memory-utilization", "0.02"]


def test_the_checkpoint_has_the_shape_the_tokenizer_and_shards(tmp_path):
    cfg = full_size.SHAPES["small"]["config"]
    out = full_size.write_checkpoint(cfg, tmp_path / "ck", shard_bytes=2 << 20)
    shards = sorted(out.glob("*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) > 1 and set(index["weight_map"].values()) == {p.name for p in shards}
    assert (out / "tokenizer.json").exists() and json.loads((out / "config.json").read_text())["vocab_size"] == 49152
    loaded = load_weights(str(out), device="cpu")
    assert loaded.dtype == torch.bfloat16 and loaded.tokenizer is not None  # dtype auto: the checkpoint's
    w = loaded.model.model.layers[1].mlp.up_proj.weight
    assert w.shape == (128, 64) and 0.015 < w.float().std() < 0.025
    assert torch.equal(loaded.model.model.norm.weight, torch.ones(64, dtype=torch.bfloat16))
    tok = tmp_path / "tok"  # a tokenizer directory alone (a GPU box without the embedded weights)
    tok.mkdir()
    for f in full_size.tokenizer_files():
        (tok / f.name).write_bytes(f.read_bytes())
    other = full_size.write_checkpoint(full_size.SHAPES["small-draft"]["config"], tmp_path / "d", tokenizer=tok)
    assert sorted(p.name for p in full_size.tokenizer_files(other)) == sorted(p.name for p in tok.iterdir())
    stamp = (out / "COMPLETE").stat().st_mtime_ns
    assert full_size.write_checkpoint(cfg, out) == out and (out / "COMPLETE").stat().st_mtime_ns == stamp  # reused


def test_small_shape_run_is_greedy_equal_and_says_its_capacity(tmp_path, capsys):
    res = full_size.main(ARGS + ["--sessions", "1,8", "--out", str(tmp_path / "small"),
                                 "--json", str(tmp_path / "r.json")])
    printed = capsys.readouterr().out
    assert f"KV pool {res['kv']['kv_pool_tokens']:,} tokens" in printed and "greedy equal: True" in printed
    assert res["kv"]["memory"]["device"] == "cpu" and res["kv"]["kv_capacity_sessions"] >= 1
    assert res["dtype"] == "torch.bfloat16" and json.loads((tmp_path / "r.json").read_text()) == res
    one, eight = res["levels"]
    assert all(r["greedy_equal"] for r in res["levels"])
    assert one["sd"]["accepted_per_round"] > 0.5  # the self draft is accepted: equality covers accepted paths
    assert eight["ar"]["mean_batch"] > 2  # the sessions' rounds share forwards
    assert all(r[k]["tokens_per_s_per_session"] > 0 for r in res["levels"] for k in ("ar", "sd"))


def test_the_run_imports_neither_ray_nor_fastapi(tmp_path):
    code = ("import sys; from benchmarks import full_size; full_size.main(sys.argv[1:]); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'fastapi', 'starlette', 'uvicorn')); "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code, *ARGS, "--sessions", "1", "--max-tokens", "4",
                        "--out", str(tmp_path / "small")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
