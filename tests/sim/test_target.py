"""sim/target.py: the production engine on the simulated target: greedy output is the synthetic
target's continuation, a right draft is accepted whole, and each forward spends its modelled cost."""

from __future__ import annotations

import asyncio

import pytest

from sim.cost_profile import CostProfile, Forward
from sim.target import SIM_VOCAB, SimRunner, continuation, next_token
from sim.virtual_time import VirtualClock, VirtualWorker, run
from specdec.engine import OpenRequest, VerifierEngine, VerifyRequest
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree
from tests.sim.test_cost_profile import _profile


class Shell:
    class config:
        vocab_size = SIM_VOCAB
        max_position_embeddings = 4096


def test_target_tokens_are_never_special_and_follow_the_rule():
    toks = continuation([5, 9, 300], 200)
    assert min(toks) >= 3 and max(toks) < SIM_VOCAB and toks[0] == next_token(300, 2)


def test_the_engine_on_the_simulated_target_decodes_the_continuation_and_spends_the_profile():
    profile = CostProfile.fit(_profile(), "synthetic")
    vc = VirtualClock()
    prompt = [7, 11, 13, 17]
    truth = continuation(prompt, 12)

    async def main():
        runner = SimRunner(profile, vc.spend, 10_000)
        engine = VerifierEngine(Shell(), runner=runner, max_model_len=4096)
        loop = asyncio.get_running_loop()
        w = VirtualWorker(loop)
        req = OpenRequest("s", prompt, SamplingParams(max_tokens=12))
        opened = (await loop.run_in_executor(w, engine.open, [req]))[0]
        t0 = vc.now
        right = DraftTree.chain(truth[1:6])  # a draft the target agrees with: accepted whole
        res = (await loop.run_in_executor(w, engine.verify, [VerifyRequest("s", right, opened.prefix_len)]))[0]
        spent = vc.now - t0
        wrong = DraftTree.chain([3, 3, 3])
        res2 = (await loop.run_in_executor(w, engine.verify, [VerifyRequest("s", wrong, res.prefix_len)]))[0]
        return opened, res, res2, spent, runner

    opened, res, res2, spent, runner = run(main(), vc)
    assert opened.first_token == truth[0]
    assert [truth[1:6][i] for i in res.accepted] == truth[1:6] and res.bonus == truth[6]
    assert list(res2.accepted) == [] and res2.bonus == truth[7]
    assert spent == pytest.approx(profile.seconds(Forward((6,), (4,))))  # root + 5 nodes over 4 KV tokens
    assert runner.kv_length("s") == len(prompt) + 7  # prompt, first token, 5 accepted, and the bonus's root
