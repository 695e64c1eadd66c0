"""benchmarks.run's plan: what both servers are given alike."""

from dataclasses import replace

from benchmarks.run import PLANS, app_config


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


def test_full_plan_gives_every_session_several_generations():
    # with 8 prompts a configuration of 16 sessions was one wave: every session opened at once,
    # decoded once and stopped, a 3-second window of ramp. The full plan keeps 8 prompts where that
    # is already 3+ a session and gives each session 3 generations elsewhere, the same share each
    plan = PLANS["full"]
    assert [plan.prompts_for(s) for s in (1, 2, 3, 4, 8, 16, 32)] == [8, 8, 9, 12, 24, 48, 96]
    one = replace(plan, generations_per_session=1)
    assert [one.prompts_for(s) for s in (1, 3, 16)] == [8, 9, 16]  # the old rule: a multiple of the sessions
