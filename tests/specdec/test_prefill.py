"""Opening sessions through the engine (specdec/prefill.py) on a tiny random Llama: invalid
opens are typed errors and touch no session; a re-open from history continues the same output."""

from __future__ import annotations

import random
import time

import pytest

from specdec.engine import OpenRequest, VerifierEngine
from specdec.errors import InvalidRequest, InvalidSamplingParams
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from tests.specdec.test_engine import EOS, drive, engine, generated, random_prompt  # noqa: F401


def test_invalid_open_requests(engine):
    res = engine.open([
        OpenRequest("a", [], SamplingParams()),
        OpenRequest("b", [5, 512], SamplingParams()),
        OpenRequest("c", [5, 6], SamplingParams(top_p=0.0)),
        OpenRequest("d", [5, 6], SamplingParams(max_tokens=2), generated=(7, 8, 9)),
        OpenRequest("e", [5, 6], SamplingParams()),
        OpenRequest("e", [7, 8], SamplingParams()),  # same sid twice in one batch
    ])
    assert isinstance(res[0], InvalidRequest) and "at least one" in res[0].message
    assert isinstance(res[1], InvalidRequest) and "vocabulary" in res[1].message
    assert isinstance(res[2], InvalidSamplingParams)
    assert isinstance(res[3], InvalidRequest)
    assert res[4].first_token is not None and isinstance(res[5], InvalidRequest)
    assert set(engine.sessions) == {"e"} and engine.sessions["e"].prefix[:2] == [5, 6]
    assert engine.runner.kv_length("e") == 2  # only one prefill entered the KV
    assert isinstance(engine.open([OpenRequest("e", [5], SamplingParams())])[0], InvalidRequest)


# -- re-open from history ----------------------------------------------------------------------
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=30),
                                    SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=30)],
                         ids=["greedy", "seeded"])
def test_reopen_from_history_continues_the_same_output(tiny_model, params):
    rng = random.Random(4)
    prompt = random_prompt(rng, 512)
    want = reference_decode(tiny_model, prompt, params, (EOS,))
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,))
    eng.open([OpenRequest("a", prompt, params)])
    drive(eng, {"a": want}, rng, max_rounds=2)
    history = tuple(generated(eng, "a"))
    eng.close("a")
    assert "a" not in eng.sessions and eng.runner.kv_length("a") == 0
    r = eng.open([OpenRequest("a", prompt, params, generated=history)])[0]
    assert r.first_token is None and r.prefix_len == len(prompt) + len(history)
    assert eng.runner.kv_length("a") == r.prefix_len - 1
    drive(eng, {"a": want}, rng)
    assert generated(eng, "a") == want


# -- an open's start_by (its deadline, issue 67) ---------------------------------------------------
def test_an_open_past_its_start_by_behind_another_prompt_is_dropped_unstarted(engine):
    now = time.monotonic()
    errs = engine.begin_open([
        OpenRequest("head", list(range(3, 40)), SamplingParams(max_tokens=2), start_by=now - 1.0),
        OpenRequest("late", [5, 6, 7], SamplingParams(max_tokens=2), start_by=now - 1.0),
        OpenRequest("fine", [8, 9], SamplingParams(max_tokens=2), start_by=now + 60.0),
        OpenRequest("free", [10, 11], SamplingParams(max_tokens=2)),
    ])
    assert errs == [None] * 4
    done = {r.sid for r in engine.prefill_step(16)}  # the head's first chunk only: the others wait
    assert done == set() and engine.take_late() == ["late"] and engine.take_late() == []
    assert "late" not in engine.prefilling and engine.runner.kv_length("late") == 0  # nothing computed
    engine.prefilling["fine"].start_by = now - 1.0  # past it now, behind the head still
    engine.prefill_step(16)
    assert engine.take_late() == ["fine"]
    while engine.prefilling:
        done |= {r.sid for r in engine.prefill_step(64)}
    assert done == {"head", "free"} and engine.take_late() == []  # the head was never dropped, late as it was
