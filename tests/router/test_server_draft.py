from deploy.router.server_draft import PromptLookupDrafter


def test_prompt_lookup_proposes_what_followed_the_last_ngram():
    d = PromptLookupDrafter(max_ngram=3, depth=4)
    hist = [1, 2, 3, 4, 5, 6, 9, 9, 2, 3]
    tree = d.draft(hist, budget=32)
    assert list(tree.tokens) == [4, 5, 6, 9] and list(tree.parents) == [-1, 0, 1, 2]
    assert len(d.draft(hist, budget=2)) == 2
    assert len(d.draft([7, 8, 9], budget=8)) == 0


def test_prompt_lookup_keeps_one_index_per_generation():
    d, fresh = PromptLookupDrafter(depth=3, max_sessions=2), lambda h: PromptLookupDrafter(depth=3).draft(h, 8)
    a, b = [1, 2, 3, 1, 2], [5, 6, 5, 6]
    indexes = None
    for step in range(4):  # two generations' rounds interleaved
        for hist in (a, b):
            assert list(d.draft(hist, 8).tokens) == list(fresh(hist).tokens)
            hist.extend([step, 1, 2])
        indexes = indexes or list(d._indexes.values())
        assert list(d._indexes.values()) == indexes  # the same two, extended round after round
    assert [ix.history for ix in indexes] == [a[:-3], b[:-3]]
    d.draft([9, 9], 8)  # a third generation drops the least recently used index
    assert list(d._indexes.values())[0] is indexes[1] and len(d._indexes) == 2
