"""sim/cost_profile.py: a verify_step JSON fitted into round costs; another model or dtype, or a
malformed file, is refused with the field named."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.cost_profile import Chunk, CostProfile, Forward, ProfileError

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _profile(coef=(0.01, 0.0005, 0.0, 1e-6, 2e-7), model="M", dtype="bfloat16") -> dict:
    rows = []
    for prefix in (128, 1024):
        for s in (1, 4, 16):
            for n in (0, 8, 16, 32):
                f = Forward((n + 1,) * s, (prefix,) * s).features()
                ms = 1000 * sum(c * x for c, x in zip(coef, f))
                rows.append({"prefix": prefix, "sessions": s, "nodes": n, "round_ms": ms})
    return {"conditions": {"model": model, "dtype": dtype, "device": "test"}, "rows": rows}


def test_the_fit_recovers_the_costs_it_was_made_from():
    p = CostProfile.fit(_profile(), "synthetic")
    assert p.coefficients == pytest.approx((0.01, 0.0005, 0.0, 1e-6, 2e-7), rel=1e-6, abs=1e-12)
    assert p.max_error < 1e-9
    assert p.seconds(Forward((9, 9), (100, 300))) == pytest.approx(0.01 + 0.0005 * 18 + 1e-6 * 400 + 2e-7 * 3600)


@pytest.mark.parametrize("name", ["verify-step-20261125-chunked.json", "verify-step-20261127-h100.json"])
def test_committed_profiles_fit_within_a_fifth(name):
    p = CostProfile.load(RESULTS / name)
    assert all(c >= 0 for c in p.coefficients) and p.max_error < 0.25, (p.coefficients, p.max_error)


def test_a_measured_round_is_its_own_cost_and_the_residual_is_held_beyond_what_was_measured():
    """The linear form times the measured rounds' residual: exact where measured, between two
    measured rows-per-session the residual in between, beyond the largest the largest's."""
    data = _profile()
    bump = next(r for r in data["rows"] if (r["prefix"], r["sessions"], r["nodes"]) == (128, 1, 0))
    bump["round_ms"] *= 1.3  # one session, one row: slower than the linear form
    p = CostProfile.fit(data, "synthetic")
    for r in data["rows"]:
        f = Forward((r["nodes"] + 1,) * r["sessions"], (r["prefix"],) * r["sessions"])
        assert 1000 * p.seconds(f) == pytest.approx(r["round_ms"], rel=1e-9)
    linear = lambda f: sum(c * x for c, x in zip(p.coefficients, f.features()))  # noqa: E731
    between = Forward((3,), (128,))  # rows 1 and 9 measured: 3 is halfway in log
    assert 1.0 < p.seconds(between) / linear(between) < p.seconds(Forward((1,), (128,))) / linear(Forward((1,), (128,)))
    beyond = Forward((500,), (128,))  # a prefill-sized chunk: 33 rows was the most measured
    edge = Forward((33,), (128,))
    assert p.seconds(beyond) / linear(beyond) == pytest.approx(p.seconds(edge) / linear(edge), rel=1e-12)


def _with_prefill(took: dict[int, float]) -> dict:
    """The synthetic profile with prefills of ``n`` tokens alone over no KV taking ``took[n]`` seconds."""
    data = _profile()
    for n, seconds in took.items():
        data["rows"].append({"group": "prefill", "prefix": 0, "tokens": n, "round_ms": 1000 * seconds})
    return data


TOOK = {16: 0.0125, 64: 0.0245, 256: 0.0705, 512: 0.1605}  # per token growing with the chunk, as a CPU's


def test_a_chunk_alone_costs_the_measured_prefill_and_its_reads_of_the_kv_before_it():
    p = CostProfile.fit(_with_prefill(TOOK), "synthetic")
    for n, seconds in TOOK.items():
        assert p.seconds(Forward((), ()), (Chunk(n, 0),)) == pytest.approx(seconds, rel=1e-12)
        assert p.seconds(Forward((), ()), (Chunk(n, 1000),)) == pytest.approx(seconds + 2e-7 * n * 1000, rel=1e-12)
    one_row = p.seconds(Forward((1,), (0,)))  # below the smallest measured: towards a one-row forward
    assert p.seconds(Forward((), ()), (Chunk(1, 0),)) == pytest.approx(one_row)
    assert one_row < p.seconds(Forward((), ()), (Chunk(8, 0),)) < TOOK[16]
    halves = p.seconds(Forward((), ()), (Chunk(128, 0), Chunk(128, 0)))  # two chunks alone: one forward of both
    assert halves == pytest.approx(TOOK[256], rel=1e-12)
    assert p.seconds(Forward((), ()), (Chunk(1024, 0),)) == pytest.approx(0.1605 + (0.1605 - 0.0705) * 2)


def test_a_chunk_riding_along_adds_the_prefill_curve_from_the_forwards_rows_on():
    """Small chunks on a small forward cost little a token (the weights are read anyway); on a full one, more."""
    p = CostProfile.fit(_with_prefill(TOOK), "synthetic")
    sixteen = Forward((1,) * 16, (128,) * 16)  # 16 rows already
    assert p.seconds(sixteen, (Chunk(48, 0),)) - p.seconds(sixteen) == pytest.approx(TOOK[64] - TOOK[16])
    one = Forward((1,), (128,))
    cheap = (p.seconds(one, (Chunk(8, 0),)) - p.seconds(one)) / 8
    dear = (p.seconds(sixteen, (Chunk(8, 0),)) - p.seconds(sixteen)) / 8
    assert cheap < dear


def test_a_longer_prefill_never_costs_less():
    p = CostProfile.fit(_with_prefill({16: 0.03, 32: 0.02, 64: 0.05}), "synthetic")  # a noisy measurement
    costs = [p.seconds(Forward((), ()), (Chunk(n, 0),)) for n in range(1, 100)]
    assert costs == sorted(costs)


def test_without_measured_prefills_a_chunk_costs_what_tree_rows_cost():
    """Each of its rows over its causal prefix: the KV before the chunk and, on average, half the chunk."""
    p = CostProfile.fit(_profile(), "synthetic")
    assert p.prefill is None
    assert p.seconds(Forward((1,), (100,)), (Chunk(64, 0),)) == pytest.approx(p.seconds(Forward((1, 64), (100, 32))))
    assert p.seconds(Forward((), ()), (Chunk(64, 1000),)) == pytest.approx(p.seconds(Forward((64,), (1032,))))


def test_a_malformed_prefill_row_is_refused_by_name():
    data = _profile()
    data["rows"].append({"group": "prefill", "prefix": 0, "round_ms": 3.0})
    with pytest.raises(ProfileError, match=r"rows\[\d+\] \(prefill\) needs tokens"):
        CostProfile.fit(data, "bad.json")
    data["rows"][-1] = {"group": "prefill", "prefix": 0, "tokens": 0, "round_ms": 3.0}
    with pytest.raises(ProfileError, match="impossible value"):
        CostProfile.fit(data, "bad.json")


def test_another_model_or_dtype_is_refused_by_name():
    p = CostProfile.fit(_profile(model="SmolLM2-135M-Instruct (embedded)"), "x.json")
    with pytest.raises(ProfileError, match="conditions.model"):
        p.check("meta-llama/Llama-3-8B", "bfloat16")
    with pytest.raises(ProfileError, match="conditions.dtype"):
        p.check("SmolLM2-135M-Instruct", "float32")
    p.check("SmolLM2-135M-Instruct", "bfloat16")  # the same: accepted


@pytest.mark.parametrize("data,field", [
    ({"rows": []}, "conditions"),
    ({"conditions": {"dtype": "bfloat16"}, "rows": []}, "conditions.model"),
    ({"conditions": {"model": "m", "dtype": "bfloat16"}, "rows": [{}] * 2}, "rows"),
    ({"conditions": {"model": "m", "dtype": "bfloat16"}, "rows": [{"sessions": 1}] * 6}, "rows[0]"),
    ({"conditions": {"model": "m", "dtype": "bfloat16"},
      "rows": [{"sessions": 0, "nodes": 0, "prefix": 1, "round_ms": 1}] * 6}, "impossible"),
])
def test_a_malformed_profile_names_what_is_wrong(data, field):
    with pytest.raises(ProfileError, match=field.replace("[", r"\[").replace("]", r"\]")):
        CostProfile.fit(data, "bad.json")


def test_an_unreadable_file_is_a_profile_error(tmp_path):
    (tmp_path / "p.json").write_text("{not json")
    with pytest.raises(ProfileError, match="JSON"):
        CostProfile.load(tmp_path / "p.json")
