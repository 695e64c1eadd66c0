"""The replica's session records (deploy/verifier/sessions.py): each gone session answers why."""

from __future__ import annotations

import pytest

from deploy.verifier.sessions import SessionBook, draft_class
from specdec.errors import ModelNotFound, SessionEvicted, SessionNotFound, VersionUnavailable


def test_a_request_for_a_session_answers_why_it_is_not_served():
    book = SessionBook()
    book.owner["a"] = "alpha"
    book.check("a", "alpha")
    with pytest.raises(SessionNotFound):  # another tenant's session is never revealed
        book.check("a", "beta")
    with pytest.raises(SessionNotFound):
        book.check("never", "alpha")
    for sid, reason, error in (("e", "kv_budget", SessionEvicted), ("r", "model_removed", ModelNotFound),
                               ("u", "model_unavailable: bad adapter", VersionUnavailable)):
        book.owner[sid] = "alpha"
        book.evict(sid, reason)
        assert sid not in book.owner
        with pytest.raises(error):
            book.check(sid, "alpha")
    book.owner["f"] = "alpha"
    book.close_finished("f")
    with pytest.raises(SessionEvicted, match="close_on_finish"):
        book.check("f", "alpha")
    book.pardon("f")
    with pytest.raises(SessionNotFound):
        book.check("f", "alpha")


def test_a_draft_class_is_a_short_string_or_none():
    assert draft_class("edge-1") == "edge-1"
    assert draft_class("") is None and draft_class(3) is None and draft_class("x" * 129) is None


def test_kv_held_counts_whole_pages_as_uses_does():
    from types import SimpleNamespace

    from specdec.model.native import PAGE_SIZE

    live = {f"s{n}": SimpleNamespace(prefix=[0] * n, last_used=0.0) for n in (1, PAGE_SIZE, PAGE_SIZE + 1, 0)}
    book = SessionBook()
    assert book.kv_held(live) == sum(u.kv_tokens for u in book.uses(live)) == 4 * PAGE_SIZE
