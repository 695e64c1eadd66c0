"""Pacing hints (deploy/verifier/hints.py): the load the tree budget weighs."""

from __future__ import annotations

from deploy.config import AppConfig


def test_the_budget_weighs_the_sessions_open_lately_not_a_dip_between_generations(monkeypatch):
    """``pacing.sessions_hold_s``: a session that finished and whose edge re-opens a round trip
    later still counts; sessions left alone for longer than the hold count as alone."""
    from deploy.verifier import deployment, hints

    core = deployment.VerifierServer(AppConfig(target={"model": "tiny-random", "dtype": "float32"},
                                             pacing={"sessions_hold_s": 1.0}))
    clock = [100.0]
    monkeypatch.setattr(hints.clock, "monotonic", lambda: clock[0])

    def load(open_sessions: int, at: float) -> int:
        clock[0] = at
        monkeypatch.setattr(core.engine, "sessions", {f"s{i}": None for i in range(open_sessions)})
        return core.hints.load_sessions()

    assert load(4, 100.0) == 4
    assert load(1, 100.3) == 4  # three finished; their edges are re-opening
    assert load(4, 100.5) == 4
    assert load(2, 101.2) == 4  # within a second of the last time four were open
    assert load(2, 101.6) == 2  # the load fell: two it is
    assert load(1, 101.7) == 2 and load(1, 102.8) == 1