"""Faults as seeded events (sim/system.py, sim/workloads/faults.yaml): a replica killed and
replaced, another killed for good, an RTT spike, a burst of opens, users vanishing mid-generation;
the invariants hold for a few seeds, and the same seed replays the same faulty run."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.__main__ import load_app, main, simulate
from sim.cost_profile import CostProfile
from sim.workload import Workload

SIM = Path(__file__).resolve().parents[2] / "sim"


def run(seed: int) -> dict:
    return simulate(load_app(SIM / "deploy-cpu.yaml"), CostProfile.load(SIM / "validation" / "verify-step-cpu.json"),
                    Workload.load(SIM / "workloads" / "faults.yaml"), seed)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_invariants_hold_through_kills_spikes_bursts_and_vanishing_users(seed):
    out = run(seed)
    assert all(out["invariants"].values()), out["invariants"]
    assert out["replicas_killed"] == 2 and out["replicas"] == 1  # r0 replaced, r1 gone for good
    assert out["reopens"] > 0 and out["users"] == 48  # sessions of the killed replicas re-opened; the burst came
    assert out["outcomes"].get("vanished", 0) > 0 and out["outcomes"].get("finished", 0) > 0
    assert out["diverged_rounds"] == 0 and out["errors"] == 0


def test_a_faulty_run_replays_from_its_seed():
    assert run(5)["trace_sha256"] == run(5)["trace_sha256"]


def test_a_fault_on_a_replica_the_deployment_lacks_is_refused(tmp_path, capsys):
    w = tmp_path / "w.yaml"
    w.write_text("users: 2\nduration_s: 5\nwarmup_s: 1\ntenants: {gold: 1}\n"
                 "faults: [{at_s: 1, kind: kill_replica, replica: 5}]\n")
    rc = main(["run", "--config", str(SIM / "deploy-cpu.yaml"), "--profile",
               str(SIM / "validation" / "verify-step-cpu.json"), "--workload", str(w)])
    assert rc == 2 and "faults[0].replica" in capsys.readouterr().err


def test_the_cli_refuses_a_profile_of_another_model_naming_the_field(tmp_path, capsys):
    rc = main(["run", "--config", str(SIM / "deploy-8b-h100.yaml"), "--profile",
               str(SIM / "validation" / "verify-step-cpu.json"), "--workload",
               str(SIM / "workloads" / "fleet-8b.yaml")])
    assert rc == 2 and "conditions.model" in capsys.readouterr().err
