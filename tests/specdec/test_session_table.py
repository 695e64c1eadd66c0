"""SessionTable: the lookups and finish rules the engine's collaborators share."""

import pytest

from specdec.engine_types import Session
from specdec.errors import ModelNotFound, PrefixMismatch, SessionFinished, SessionNotFound
from specdec.sampling import SamplingParams
from specdec.session_table import SessionTable


class Runner:
    """Records the KV calls a table makes."""

    def __init__(self):
        self.dropped, self.cached = [], []

    def drop(self, sid):
        self.dropped.append(sid)

    def kv_length(self, sid):
        return 2

    def cache_prefix(self, sid, tokens, salt):
        self.cached.append((sid, list(tokens), salt))


def table(max_model_len=16, prefix_caching=False):
    return SessionTable(Runner(), max_model_len=max_model_len, prefix_caching=prefix_caching)


def session(t, sid="a", prefix=(1, 2, 3), max_tokens=4, stop=frozenset({9})):
    s = Session(sid, list(prefix), len(prefix), SamplingParams(max_tokens=max_tokens), None, stop)
    t.sessions[sid] = s
    return s


def test_live_checks_the_prefix_the_finish_and_the_version():
    t = table()
    s = session(t)
    assert t.live("a", 3) is s
    with pytest.raises(PrefixMismatch):
        t.live("a", 2)
    with pytest.raises(SessionNotFound):
        t.get("b")
    s.adapter = "code"
    with pytest.raises(ModelNotFound):  # no versions served
        t.live("a", 3)
    s.adapter, s.finished, s.finish_reason = None, True, "stop"
    with pytest.raises(SessionFinished):
        t.live("a", 3)


def test_emit_finishes_on_a_stop_token_and_drops_the_kv():
    t = table()
    s = session(t)
    t.emit(s, [5])
    assert not s.finished and t.remaining(s) == 3
    t.emit(s, [9])
    assert (s.finished, s.finish_reason, t.runner.dropped) == (True, "stop", ["a"])


def test_emit_finishes_at_max_tokens_or_the_context_and_offers_the_kv_to_the_cache():
    t = table(prefix_caching=True)
    s = session(t, max_tokens=2)
    t.emit(s, [5, 6])
    assert (s.finished, s.finish_reason) == (True, "length")
    assert t.runner.cached == [("a", [1, 2], (None, None, 0))]
    t = table(max_model_len=6)
    s = session(t, max_tokens=100)
    assert t.remaining(s) == 2  # the context: max_model_len - 1 - len(prefix)
    t.emit(s, [5, 6])
    assert (s.finished, s.finish_reason) == (True, "length")


def test_a_repointed_version_gets_a_new_salt():
    t = table()
    s = session(t)
    s.adapter = "code"
    before = t.salt(s)
    t.version_epoch["code"] = 1
    assert t.salt(s) != before
