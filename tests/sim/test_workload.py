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
