"""sim/cost_profile.py: a verify_step JSON fitted into round costs; another model or dtype, or a
malformed file, is refused with the field named."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.cost_profile import CostProfile, Forward, ProfileError

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
