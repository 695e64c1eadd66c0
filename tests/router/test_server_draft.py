from deploy.router.server_draft import PromptLookupDrafter


def test_prompt_lookup_proposes_what_followed_the_last_ngram():
    d = PromptLookupDrafter(max_ngram=3, depth=4)
    hist = [1, 2, 3, 4, 5, 6, 9, 9, 2, 3]
    tree = d.draft(hist, budget=32)
    assert list(tree.tokens) == [4, 5, 6, 9] and list(tree.parents) == [-1, 0, 1, 2]
    assert len(d.draft(hist, budget=2)) == 2
    assert len(d.draft([7, 8, 9], budget=8)) == 0
