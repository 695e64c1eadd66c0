"""The ``edge-agent`` command: --local generation, JSON summary, clear errors."""

from __future__ import annotations

import json

import pytest

from specdec.model.loading import tiny_random_model
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from edge_agent.cli import main
from tests.conftest import free_port

PROMPT = [1, 5, 9, 33, 7]


@pytest.fixture(scope="module")
def reference():
    model = tiny_random_model(seed=0)
    return reference_decode(model, PROMPT, SamplingParams(max_tokens=24, ignore_eos=True), [2])


@pytest.mark.parametrize("draft,mode,verify", [
    ("tiny-random", "proactive", "match"), ("ngram", "stop-and-wait", "match"), ("none", "proactive", "match"),
    ("tiny-random", "proactive", "rejection"), ("none", "stop-and-wait", "rejection")])
def test_local_generate_json_matches_reference(capsys, reference, draft, mode, verify):
    rc = main(["generate", "--local", "--target", "tiny-random", "--dtype", "float32", "--draft", draft,
               "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "24", "--ignore-eos",
               "--mode", mode, "--verify", verify, "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == reference and out["verify"] == verify
    st = out["stats"]
    assert st["tokens"] == 24 and st["finish_reason"] == "length"
    for key in ("tokens_per_s", "mean_accepted", "alignment_rate", "mean_rtt_ms", "rounds"):
        assert key in st
    if draft == "tiny-random":  # the same weights as the target: every drafted level is accepted
        assert st["accepted_tokens"] > 0 and st["mean_accepted"] >= 1
    if draft == "none":
        assert st["accepted_tokens"] == 0 and st["rounds"] == 23


LOCAL = ["generate", "--local", "--target", "tiny-random", "--dtype", "float32", "--prompt-ids",
         ",".join(map(str, PROMPT)), "--max-tokens", "24", "--ignore-eos", "--json"]


def _run(capsys, *args: str) -> dict:
    assert main(LOCAL + list(args)) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("verify", ["tree-rejection", "auto"])
def test_local_greedy_tree_rejection_and_auto_are_match_trees(capsys, reference, verify, tmp_path):
    out = _run(capsys, "--draft", "tiny-random", "--verify", verify, "--verify-state", str(tmp_path / "s.json"))
    assert out["token_ids"] == reference and out["verify"] == verify and out["stats"]["verify_rule"] == "match"
    assert not (tmp_path / "s.json").exists()  # greedy requests teach auto nothing


@pytest.mark.parametrize("verify, mode", [("rejection", "proactive"), ("rejection", "stop-and-wait"),
                                          ("tree-rejection", "stop-and-wait")])
def test_local_sampled_rejection_rules_accept_draft_tokens(capsys, verify, mode):
    """Sampled (T = 1, top-p 0.95) through --local with a draft sharing the target's weights: chain
    rejection accepts min(1, p/q) = 1 everywhere; tree rejection's 16-entry proposals of the flat
    512-token rows hold little of p, so fewer, but some."""
    out = _run(capsys, "--draft", "tiny-random", "--verify", verify, "--mode", mode, "--temperature", "1.0",
               "--top-p", "0.95", "--seed", "7")
    st = out["stats"]
    assert st["verify_rule"] == verify and st["tokens"] == 24 and st["finish_reason"] == "length"
    if verify == "rejection":
        assert st["accepted_tokens"] >= st["rounds"] and st["rejections"] == 0
    else:
        assert st["accepted_tokens"] > 0 and st["draft_tokens"] > st["rounds"]  # trees, partly accepted
    assert all(0 <= t < 512 for t in out["token_ids"])


def test_local_sampled_auto_learns_across_runs_in_its_state_file(capsys, tmp_path, monkeypatch):
    from edge_agent.verify_policy import PolicyStore, VerifyPolicy

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sampled = ["--draft", "tiny-random", "--verify", "auto", "--temperature", "1.0", "--seed", "3",
               "--mode", "stop-and-wait"]
    out = _run(capsys, *sampled)
    assert out["stats"]["verify_rule"] == "match"  # the prior at T = 1.0, nothing measured yet
    default = tmp_path / "cache" / "specedge" / "verify_policy.json"  # the default state file
    doc = json.loads(default.read_text())
    ((pair, entry),) = doc["pairs"].items()
    assert pair == "tiny-random(seed=0)|tiny-random(seed=0)"  # (target, draft)
    assert [e["rule"] for e in entry["evidence"]] == ["match"]
    learned = VerifyPolicy()
    PolicyStore(default).load(pair, learned)
    tok, n = learned.evidence[("match", 1.0)]
    st = out["stats"]
    assert tok == pytest.approx(st["accepted_tokens"] + st["rounds"]) and n == st["rounds"]
    # the next run starts from what the first one measured
    want = learned.choose(SamplingParams(temperature=1.0))
    assert _run(capsys, *sampled)["stats"]["verify_rule"] == want
    # another state file whose history has chains accepting far more at T = 1.0 on this pair
    entry["evidence"].append({"rule": "rejection", "temperature": 1.0, "tokens": 500.0, "rounds": 100.0})
    state = tmp_path / "mine.json"
    state.write_text(json.dumps(doc))
    assert _run(capsys, *sampled, "--verify-state", str(state))["stats"]["verify_rule"] == "rejection"
    before = default.read_text()
    assert _run(capsys, *sampled, "--no-verify-state")["stats"]["verify_rule"] == "match"  # the prior
    assert default.read_text() == before  # opted out: nothing written


def test_local_generate_streams_and_ends_with_a_summary(capsys, reference):
    rc = main(["generate", "--local", "--target", "tiny-random", "--dtype", "float32", "--draft", "tiny-random",
               "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "24", "--ignore-eos"])
    assert rc == 0
    cap = capsys.readouterr()
    assert [int(x) for x in cap.out.split()] == reference
    summary = cap.err.strip().splitlines()[-1]
    assert "24 tokens" in summary and "tok/s" in summary and "tokens/round" in summary
    assert "drafted and accepted" in summary and "run ahead" in summary
    assert "alignment" in summary and "RTT" in summary


def test_the_summary_says_what_a_round_delivered(capsys):
    """Every token but the open's first came from a round: accepted drafts, a bonus, run-ahead."""
    st = _run(capsys, "--draft", "tiny-random")["stats"]
    assert st["round_tokens"] == st["tokens"] - 1 and st["tokens_per_round"] == st["round_tokens"] / st["rounds"]
    assert st["accepted_tokens"] + st["ahead_tokens"] < st["round_tokens"] <= st["accepted_tokens"] + \
        st["ahead_tokens"] + st["rounds"]
    assert st["mean_ahead"] == st["ahead_tokens"] / st["rounds"]


@pytest.fixture(scope="module")
def tokenizers():
    """The embedded model's tokenizer (it has a chat template) and a copy without one."""
    import copy

    from specdec.model.loading import load_tokenizer

    tok = load_tokenizer("embedded")
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    return tok, bare


def test_a_text_prompt_goes_through_the_chat_template_when_the_tokenizer_has_one(tokenizers):
    """As vLLM's ``LLM.chat`` and the edge server's /v1/chat/completions (the same function); --raw
    sends the bare text; ids are sent as given."""
    from edge_agent.cli import _prompt, build_parser
    from specdec.openai import chat_prompt

    tok, bare = tokenizers
    q = "What is a Dyson sphere?"

    def prompt(tokenizer, *flags):
        return _prompt(build_parser().parse_args(["generate", "--local", "--prompt", q, *flags]), tokenizer)

    assert prompt(tok) == prompt(tok, "--chat") == chat_prompt([{"role": "user", "content": q}], tok)
    assert prompt(tok, "--raw") == prompt(bare) == q
    with pytest.raises(SystemExit, match="--raw sends the bare prompt"):
        prompt(bare, "--chat")
    with pytest.raises(SystemExit):  # one or the other
        build_parser().parse_args(["generate", "--prompt", q, "--chat", "--raw"])
    ids = build_parser().parse_args(["generate", "--local", "--prompt-ids", "1,5,9"])
    assert _prompt(ids, tok) == [1, 5, 9]


@pytest.mark.slow
def test_the_embedded_instruct_model_answers_a_bare_question(capsys):
    """Issue 62: ``--prompt "What is a Dyson sphere?"`` on the embedded Instruct model printed one
    empty token (the bare text's likeliest next token is EOS); as a chat message it gets an answer."""
    out = json.loads(_generate_embedded(capsys, "--max-tokens", "8"))
    assert out["stats"]["tokens"] == 8 and out["text"].strip() and out["prompt_tokens"] > 7


def _generate_embedded(capsys, *args: str) -> str:
    assert main(["generate", "--local", "--target", "embedded", "--draft", "ngram", "--prompt",
                 "What is a Dyson sphere?", "--json", *args]) == 0
    return capsys.readouterr().out


def test_unreachable_server_is_one_clear_line(capsys):
    port = free_port()  # nothing listens there
    rc = main(["generate", "--server", f"http://127.0.0.1:{port}", "--prompt-ids", "1,2,3", "--draft", "ngram"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "cannot reach the server" in err and str(port) in err


def test_usage_errors():
    with pytest.raises(SystemExit, match="give --server"):
        main(["generate", "--prompt-ids", "1,2", "--draft", "ngram"])
    with pytest.raises(SystemExit, match="neither a known name nor an existing path"):
        main(["generate", "--local", "--target", "tiny-random", "--draft", "/no/such/draft",
              "--prompt-ids", "1,2"])


def test_metrics_port_exposes_edge_metrics(capsys):
    import threading
    import time
    import urllib.request

    port = free_port()
    scraped = {}

    def scrape():  # while the command lingers after the generation
        for _ in range(200):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
                    text = r.read().decode()
                if "specedge_edge_generated_tokens_total 12.0" in text:
                    scraped["text"] = text
                    return
            except OSError:
                pass
            time.sleep(0.05)

    t = threading.Thread(target=scrape)
    t.start()
    rc = main(["generate", "--local", "--target", "tiny-random", "--dtype", "float32", "--draft", "tiny-random",
               "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "12", "--ignore-eos", "--json",
               "--metrics-port", str(port), "--metrics-linger", "3"])
    t.join()
    assert rc == 0
    assert "specedge_edge_spec_decode_num_drafts_total" in scraped["text"]


def test_version_is_the_installed_packages(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"edge-agent {version('specedge-serve')}"
