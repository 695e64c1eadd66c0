"""benchmarks.run's plan: what both servers are given alike, and how repeats are ordered and pooled."""

from dataclasses import asdict, replace

import pytest

from benchmarks.metrics import Window
from benchmarks.run import main
from benchmarks.run_plan import PLANS, app_config, repeat_order
from benchmarks.run_report import config_row
from tests.benchmarks.test_child_group import FAKE_SERVE


def test_our_batch_cap_is_the_vllm_peers_max_num_seqs():
    # one forward may carry every session of the largest configuration, ours as vLLM's: with a cap
    # of 16 against vLLM's 32, half our sessions waited a forward at 32 sessions
    plan = replace(PLANS["full"], sessions=[1, 4, 32])
    assert plan.batch_cap() == 32
    assert app_config(plan, "embedded-draft", 4)["verifier"]["max_batch_sessions"] == 32
    assert replace(PLANS["full"], rtt_sessions=2, sessions=[1, 2]).batch_cap() == 16  # 16 at least
    # an explicit --set still wins
    plan = replace(plan, app_set={"verifier.max_batch_sessions": 8})
    assert app_config(plan, "embedded-draft", 4)["verifier"]["max_batch_sessions"] == 8


@pytest.mark.parametrize("item, says", [("model.dtype=\"float32\"", "Extra inputs are not permitted"),
                                         ("target.dtype=\"float33\"", "target.dtype")])
def test_a_wrong_set_is_refused_before_anything_starts(item, says, capsys):
    # a key or value the app config refuses stops the run at its command line, with pydantic's reason,
    # instead of a Serve app that dies at start-up behind "did not start"
    with pytest.raises(SystemExit) as e:
        main(["--quick", "--set", item])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "not a valid app config" in err and says in err


def test_full_plan_gives_every_session_several_generations():
    # with 8 prompts a configuration of 16 sessions was one wave: every session opened at once,
    # decoded once and stopped, a 3-second window of ramp. The full plan keeps 8 prompts where that
    # is already 3+ a session and gives each session 3 generations elsewhere, the same share each
    plan = PLANS["full"]
    assert [plan.prompts_for(s) for s in (1, 2, 3, 4, 8, 16, 32)] == [8, 8, 9, 12, 24, 48, 96]
    one = replace(plan, generations_per_session=1)
    assert [one.prompts_for(s) for s in (1, 3, 16)] == [8, 9, 16]  # the old rule: a multiple of the sessions


def test_repeats_alternate_the_order_so_no_mode_always_runs_first():
    runs = [("server_ar", None), ("server_sd", None), ("edge_full", "match")]
    orders = [repeat_order(runs, k) for k in range(4)]
    assert orders[0] == orders[2] == runs and orders[1] == orders[3] == runs[::-1]
    # over two repeats every run has the same mean position (ABBA): a drift favours none
    assert len({orders[0].index(r) + orders[1].index(r) for r in runs}) == 1
    assert PLANS["full"].repeats == 2 and PLANS["quick"].repeats == 1


def _repeat(tokens, cpu_s, itl_s):
    window = asdict(Window(wall_s=1.0, verifier_busy_s=cpu_s, server_draft_cpu_s=0.0, tokens_emitted=tokens,
                           up_bytes=0, down_bytes=0, verifier_cpu_s=cpu_s, server_cpu_s=cpu_s))
    gens = [{"tokens": tokens, "seconds": 1.0, "ttft_s": 0.1, "rounds": tokens - 1,
             "arrivals": [(i * itl_s, 1) for i in range(tokens)]}]
    return {"wall_s": 1.0, "gens": gens}, {"window": window, "server_cpu": {"by_role": {"router": cpu_s}}}


def test_a_configurations_repeats_pool_into_one_row_with_each_repeats_figure():
    got = [_repeat(100, 1.0, 0.010), _repeat(300, 2.0, 0.020)]
    r = config_row("server_ar", None, 15.0, 2, got, depth=0, temperature=0.0)
    assert r["tokens_per_server_cpu_s"] == pytest.approx(400 / 3.0)  # total over total
    assert r["repeat_tokens_per_server_cpu_s"] == pytest.approx([100.0, 150.0]) and r["repeats"] == 2
    assert r["itl_ms_p50"] == pytest.approx(20.0)  # the pooled samples: 99 at 10 ms, 299 at 20 ms
    assert r["tokens"] == 400 and r["verify"] == "-"
    one = config_row("server_ar", None, 15.0, 2, got[:1], depth=0, temperature=0.0)
    assert one["repeats"] == 1 and one["repeat_tokens_per_server_cpu_s"] == [one["tokens_per_server_cpu_s"]]


@pytest.mark.parametrize("fails", ["startup timeout", "other error"])
def test_server_start_retries_once_when_rays_node_times_out(tmp_path, monkeypatch, fails):
    # Ray gives its node a fixed 30 s to register; on a loaded server core that was exceeded (a CI run):
    # the harness starts the server once more. Any other failure is reported at once, with its log
    import sys

    import benchmarks.run_harness as run

    script = FAKE_SERVE if fails == "startup timeout" else FAKE_SERVE.replace("The current node", "Another node")
    port = run.free_port()
    monkeypatch.setattr(run, "free_port", lambda: port)
    monkeypatch.setattr(run, "free_direct_port", lambda: port)  # where clients connect, by default
    monkeypatch.setattr(run, "pinned", lambda cmd, core, nice: [sys.executable, "-c", script, str(tmp_path / "t"),
                                                                str(port)])
    server = run.Server({}, tmp_path, nice=0)
    try:
        if fails == "other error":
            with pytest.raises(RuntimeError, match="did not start(.|\n)*Another node timed out"):
                server.wait_ready(timeout=30)
            assert (tmp_path / "t").read_text() == "x"
        else:
            assert server.wait_ready(timeout=30) == "READY fake; second try: Ray's node timed out starting the first"
            assert (tmp_path / "t").read_text() == "xx"
            assert "timed out during startup" in (tmp_path / "serve.first-try.log").read_text()
    finally:
        server.proc.stop()


# a start that fails the way a refused app config did: Ray prints a line on stdout as it shuts down,
# and the reason reaches stderr only after that (here: a helper holding the pipe, then the traceback)
STRAY_THEN_FAIL = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])  # keeps stdout open past our exit
print("(raylet) Task ServeController.graceful_shutdown failed.", flush=True)
time.sleep(1.0)
sys.exit("pydantic_core.ValidationError: 1 validation error for AppConfig")
"""
STRAY_THEN_READY = """
import time
print("(raylet) a line of Ray's own", flush=True)
time.sleep(0.5)
print("READY fake", flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("script", ["fail", "ready"])
def test_a_start_is_judged_by_ready_or_the_end_not_by_a_stray_line(tmp_path, monkeypatch, script):
    import sys

    import benchmarks.run_harness as run

    code = STRAY_THEN_FAIL if script == "fail" else STRAY_THEN_READY
    monkeypatch.setattr(run, "pinned", lambda cmd, core, nice: [sys.executable, "-c", code])
    server = run.Server({}, tmp_path, nice=0)
    try:
        if script == "fail":  # the reason, which came after the stray line, is in the error
            with pytest.raises(RuntimeError, match="did not start(.|\n)*graceful_shutdown(.|\n)*ValidationError"):
                server.wait_ready(timeout=30)
        else:
            assert server._ready_line(timeout=30) == "READY fake\n"
            assert "a line of Ray's own" in (tmp_path / "serve.log").read_text()
    finally:
        server.proc.stop()
