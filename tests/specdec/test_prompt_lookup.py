import math
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.prompt_lookup import NgramIndex

histories = st.lists(st.integers(0, 4), max_size=40)


def scan(history: list[int], context: list[int], max_n: int = 4, min_n: int = 1) -> list[int]:
    """Positions of the tokens that followed the longest suffix of ``context`` seen in ``history``."""
    for n in range(min(max_n, len(context)), min_n - 1, -1):
        at = [i for i in range(n, len(history)) if history[i - n : i] == context[-n:]]
        if at:
            return at
    return []


@settings(max_examples=300, deadline=None)
@given(histories, st.integers(-1, 6))
def test_continuation_is_what_followed_the_latest_match(history, k):
    at = scan(history, history)
    want = history[max(at) : max(at) + k] if at and k > 0 else []
    ix = NgramIndex()
    ix.extend(history)
    assert ix.continuation(history, k) == want


@settings(max_examples=300, deadline=None)
@given(histories, st.lists(st.integers(0, 4), max_size=4), st.integers(1, 4))
def test_ranked_counts_the_followers_most_often_then_most_recent_first(history, path, k):
    context = history + path
    at = scan(history, context)
    counts, last = Counter(history[i] for i in at), {history[i]: i for i in at}
    want = sorted(counts, key=lambda t: (-counts[t], -last[t]))[:k]
    ix = NgramIndex()
    ix.extend(history)
    toks, lps = ix.ranked(context, k)
    assert toks == want
    assert all(math.isclose(lp, math.log(counts[t] / len(at))) for t, lp in zip(toks, lps))


@settings(max_examples=200, deadline=None)
@given(histories, histories)
def test_extending_matches_indexing_from_scratch(first, second):
    grown = NgramIndex()
    grown.extend(first)
    grown.extend(first + second)  # incremental
    grown.extend(second)  # not an extension: rebuilt
    fresh = NgramIndex()
    fresh.extend(second)
    assert grown.history == fresh.history
    assert {n: dict(d) for n, d in grown.index.items()} == {n: dict(d) for n, d in fresh.index.items()}
