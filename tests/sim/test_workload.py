"""sim/workload.py: a workload file with an unknown key or an impossible value is one clear
message naming the field."""

from __future__ import annotations

import pytest

from sim.workload import Workload


def test_defaults_are_valid_and_devices_have_draft_times():
    w = Workload()
    assert w.device_ms() == {"rtx4090": 11.0}


@pytest.mark.parametrize("text,field", [
    ("usres: 10\n", "usres"),
    ("users: 0\n", "users"),
    ("network: {rtt_ms: -5}\n", "network.rtt_ms"),
    ("network: {rtt: 5}\n", "network.rtt"),
    ("acceptance: {alpha: 1.5}\n", "acceptance.alpha"),
    ("prompt_tokens: [50, 10]\n", "prompt_tokens"),
    ("prompt_lengths: [50, 0]\n", "prompt_lengths"),
    ("prompt_lengths: []\n", "prompt_lengths"),
    ("draft_ms: {rtx4090: .nan}\n", "draft_ms.rtx4090"),
    ("network: {rtt_ms: .inf}\n", "network.rtt_ms"),
    ("draft_ms: {rtx4090: -3}\n", "draft_ms.rtx4090"),
    ("depth_policy: bogus\n", "depth_policy"),
    ("client: robot\n", "client"),
    ("budget: 0\n", "budget"),
    ("devices: {pixel: 1.0}\n", "pixel"),
    ("duration_s: 10\nwarmup_s: 20\n", "warmup_s"),
    ("mode: turbo\n", "mode"),
    ("- 1\n- 2\n", "mapping"),
])
def test_bad_workloads_name_the_field(tmp_path, text, field):
    path = tmp_path / "w.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=field.replace("[", r"\[")) as e:
        Workload.load(path)
    assert str(path) in str(e.value)


def test_a_device_of_ones_own_with_its_draft_time(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("devices: {orin-nano: 2.0, rtx4090: 1.0}\ndraft_ms: {orin-nano: 60}\n")
    assert Workload.load(path).device_ms() == {"orin-nano": 60.0, "rtx4090": 11.0}


def test_prompt_lengths_are_dealt_as_benchmarks_run_deals_its_prompts():
    """benchmarks.run gives session i the prompts[i::S]: user i's g-th generation, entry g * S + i."""
    import random

    lengths = [10, 11, 12, 13, 14, 15]
    w = Workload(users=3, prompt_lengths=lengths)
    for user in range(3):
        assert [w.prompt_length(user, g, None) for g in range(2)] == lengths[user::3]
    rng = random.Random(0)
    assert 16 <= Workload(prompt_tokens=(16, 64)).prompt_length(0, 0, rng) <= 64
