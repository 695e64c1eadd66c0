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


def _with_prefill(per_token=0.0001) -> dict:
    """Prefills of the synthetic profile's forward: its empty forward (0.01 s), ``per_token`` a token, and
    its attention (2e-7 s per row and KV token read)."""
    data = _profile()
    for n in (16, 64, 256, 512):
        data["rows"].append({"group": "prefill", "prefix": 0, "tokens": n,
                             "round_ms": 1000 * (0.01 + per_token * n + 2e-7 * n * n / 2)})
    return data


def test_a_prefill_chunk_costs_its_tokens_and_attention_and_rides_along_without_the_empty_forward():
    p = CostProfile.fit(_with_prefill(), "synthetic")
    assert (p.prefill.base, p.prefill.per_token, p.prefill.attention) == pytest.approx((0.01, 0.0001, 2e-7))
    alone = p.seconds(Forward((), ()), (Chunk(256, 0),))
    assert alone == pytest.approx(0.01 + 0.0001 * 256 + 2e-7 * 256 * 128)
    decode = Forward((1, 1), (128, 300))
    both = p.seconds(decode, (Chunk(256, 0), Chunk(64, 0)))
    assert both == pytest.approx(p.seconds(decode) + alone - 0.01 + 0.0001 * 64 + 2e-7 * 64 * 32)
    over_kv = p.seconds(Forward((), ()), (Chunk(64, 1000),))  # a chunk over KV: its rows read it
    assert over_kv == pytest.approx(0.01 + 0.0001 * 64 + 2e-7 * 64 * 1032)


def test_a_measured_prefill_rides_along_for_what_it_took_beyond_the_empty_forward():
    """Per-token costs that grow with the chunk (as a CPU's do): at each measured size, a chunk riding
    along a verify forward adds its measured time less the empty forward's (the weights read once)."""
    data = _profile()
    took = {16: 0.002, 64: 0.012, 256: 0.06, 512: 0.15}  # beyond the empty forward's 0.01 s
    for n, s in took.items():
        data["rows"].append({"group": "prefill", "prefix": 0, "tokens": n, "round_ms": 1000 * (0.01 + s)})
    p = CostProfile.fit(data, "synthetic")
    decode = Forward((1, 1, 1, 1), (128, 128, 128, 128))
    for n, s in took.items():
        assert p.seconds(decode, (Chunk(n, 0),)) - p.seconds(decode) == pytest.approx(s, rel=1e-9)
        assert p.seconds(Forward((), ()), (Chunk(n, 0),)) == pytest.approx(0.01 + s, rel=1e-9)


def test_without_measured_prefills_a_chunk_costs_what_tree_rows_cost():
    """Each of its rows over its causal prefix: the KV before the chunk and, on average, half the chunk."""
    p = CostProfile.fit(_profile(), "synthetic")
    assert p.prefill is None
    assert p.seconds(Forward((1,), (100,)), (Chunk(64, 0),)) == pytest.approx(p.seconds(Forward((1, 64), (100, 32))))
    assert p.seconds(Forward((), ()), (Chunk(64, 1000),)) == pytest.approx(p.seconds(Forward((64,), (1032,))))


def test_too_few_prefill_rows_are_refused_by_name():
    data = _profile()
    data["rows"].append({"group": "prefill", "prefix": 0, "tokens": 16, "round_ms": 3.0})
    with pytest.raises(ProfileError, match="prefill rows"):
        CostProfile.fit(data, "bad.json")
    data["rows"][-1] = {"group": "prefill", "prefix": 0, "round_ms": 3.0}
    with pytest.raises(ProfileError, match=r"rows\[\d+\] \(prefill\) needs tokens"):
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
