"""specdec/grammar.py: grammars compiled once, masks per tree node by its path, and the engine's
output through trees equal to target-only constrained decoding (tiny random Llama, fp32; its 512 ids
are the embedded tokenizer's first 512: bytes and short pieces, enough for JSON)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from specdec.engine import OpenRequest, VerifierEngine
from specdec.errors import InvalidRequest
from specdec.grammar import GrammarCompiler, GrammarSpec
from specdec.model.loading import load_tokenizer
from specdec.openai.tools import FORMATS, Tool
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree
from tests.specdec.test_engine import EOS, drive, generated, random_prompt, random_tree

SPECS = [
    GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {
        # (not maxLength: XGrammar 0.2.9 lets such a string hold raw control characters, invalid JSON)
        "name": {"type": "string", "pattern": "^[a-z ]{1,8}$"}, "n": {"type": "integer"}}, "required": ["name", "n"]})),
    GrammarSpec("json_object"),
    GrammarSpec("regex", r"[a-c]{2,5}-\d{1,3}"),
    GrammarSpec("choice", json.dumps(["yes", "no", "maybe later"])),
    GrammarSpec("ebnf", 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9]+ | "x"'),
    # tool calls (structural tags): SmolLM2's list of calls, one Hermes call
    FORMATS["smollm2"].grammar([Tool("add", {"type": "object", "properties": {"a": {"type": "integer"}},
                                             "required": ["a"]}, {}), Tool("no", {"enum": [1, 2]}, {})], True),
    FORMATS["hermes"].grammar([Tool("pick", {"type": "object", "properties": {"x": {"enum": ["p", "q"]}},
                                             "required": ["x"]}, {})], False),
]


@pytest.fixture(scope="module")
def compiler(tiny_model):
    return GrammarCompiler(load_tokenizer("embedded"), tiny_model.config.vocab_size, (EOS,))


def _allowed(bits: torch.Tensor, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(bits[t // 32]) >> (t % 32)) & 1}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_a_nodes_mask_is_its_paths_state(compiler, spec):
    """Every reachable node's row equals a fresh matcher fed the node's path; the session's matcher
    is where it was before."""
    rng = random.Random(0)
    V = compiler.vocab_size
    state = compiler.state(spec)
    for _ in range(30):
        # a tree of grammatical and random tokens: walk the grammar a few steps for real tokens
        probe, tokens, parents = compiler.state(spec), [], []
        for depth in range(rng.randint(1, 6)):
            allowed = sorted(_allowed(probe.masks(DraftTree.empty())[0], V))
            if not allowed:
                break
            tokens.append(rng.choice(allowed) if rng.random() < 0.8 else rng.randrange(V))
            parents.append(depth - 1)
            if not probe.allows(tokens[-1:]):
                break
            probe.accept(tokens[-1:])
        for _ in range(rng.randint(0, 6)):  # random siblings and branches
            parents.append(rng.randrange(-1, len(tokens)))
            tokens.append(rng.randrange(V))
        tree = DraftTree(tuple(tokens), tuple(parents))
        masks = state.masks(tree)
        for row in range(len(tree) + 1):
            path, node = [], row - 1
            while node >= 0:
                path.append(tree.tokens[node])
                node = tree.parents[node]
            fresh = compiler.state(spec)
            if not fresh.allows(path[::-1]):
                continue  # unreachable: the walk never reads its row
            fresh.accept(path[::-1])
            assert _allowed(masks[row], V) == _allowed(fresh.masks(DraftTree.empty())[0], V), (row, path)
        assert state.masks(DraftTree.empty()).equal(compiler.state(spec).masks(DraftTree.empty()))


def test_grammars_compile_once_and_bad_ones_are_400s_naming_the_problem(compiler):
    spec = SPECS[0]
    assert compiler.compile(spec) is compiler.compile(GrammarSpec(spec.kind, spec.value))
    for bad, words in [(GrammarSpec("json_schema", '{"type": "objectx"}'), "objectx"),
                       (GrammarSpec("json_schema", "{not json"), "json_schema"),
                       (GrammarSpec("regex", "[a-"), "regex"),
                       (GrammarSpec("ebnf", "root ::= foo"), "foo"),
                       (GrammarSpec("choice", "[]"), "non-empty")]:
        with pytest.raises(InvalidRequest, match=words):
            compiler.compile(bad)
    for wire in [{"kind": "xml"}, {"kind": "regex", "value": 3}, "regex", {"kind": "regex", "extra": 1}]:
        with pytest.raises(InvalidRequest, match="grammar"):
            GrammarSpec.of(wire)
    assert GrammarSpec.of(SPECS[2].to_wire()) == SPECS[2] and len(SPECS[2].key) == 32


@pytest.mark.parametrize("seed", range(3))
def test_greedy_output_through_trees_equals_target_only_constrained_decoding(tiny_model, compiler, seed):
    """Sessions with each grammar (and one without) share batches; random trees with the constrained
    continuation partly inside; every round's accepted nodes and every token as the reference's."""
    rng = random.Random(seed)
    V = tiny_model.config.vocab_size
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,))
    specs = {}
    for i, spec in enumerate(SPECS + [None]):
        prompt = random_prompt(rng, V, 3, 20)
        params = SamplingParams(max_tokens=rng.randint(8, 40))
        ref = reference_decode(tiny_model, prompt, params, (EOS,), compiler.state(spec) if spec else None)
        specs[f"g{i}"] = (prompt, params, spec, ref)
    res = eng.open([OpenRequest(sid, p, prm, grammar=compiler.state(sp) if sp else None)
                    for sid, (p, prm, sp, _) in specs.items()])
    for (sid, spec), r in zip(specs.items(), res):
        assert r.first_token == spec[3][0], sid
    drive(eng, {sid: s[3] for sid, s in specs.items()}, rng, max_size=16, max_depth=6)
    for sid, (_, _, spec, ref) in specs.items():
        assert generated(eng, sid) == ref, sid
        if spec is not None and ref[-1] == EOS:  # finished by the grammar: its text is complete
            assert compiler.state(spec).allows(ref)


def test_a_constrained_json_object_parses(tiny_model, compiler):
    """The schema's output, decoded, is JSON that has the required keys (when the grammar closed it
    before max_tokens)."""
    tok = load_tokenizer("embedded")
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,))
    done = 0
    for seed in range(6):
        rng = random.Random(100 + seed)
        prompt = random_prompt(rng, tiny_model.config.vocab_size, 3, 10)
        eng.open([OpenRequest(f"j{seed}", prompt, SamplingParams(max_tokens=60), grammar=compiler.state(SPECS[0]))])
        ref = reference_decode(tiny_model, prompt, SamplingParams(max_tokens=60), (EOS,), compiler.state(SPECS[0]))
        drive(eng, {f"j{seed}": ref}, rng, max_size=8, max_depth=4)
        out = generated(eng, f"j{seed}")
        if out[-1] == EOS:
            doc = json.loads(tok.decode(out[:-1]))
            assert set(doc) == {"name", "n"} and isinstance(doc["n"], int)
            done += 1
    assert done >= 1  # at least one closed its object within 60 tokens


def test_a_reopen_replays_its_history_through_the_grammar_and_refuses_one_that_does_not_follow_it(
        tiny_model, compiler):
    rng = random.Random(7)
    V = tiny_model.config.vocab_size
    prompt, params = random_prompt(rng, V, 3, 10), SamplingParams(max_tokens=30)
    ref = reference_decode(tiny_model, prompt, params, (EOS,), compiler.state(SPECS[2]))
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,))
    cut = len(ref) // 2
    eng.open([OpenRequest("r", prompt, params, generated=tuple(ref[:cut]), grammar=compiler.state(SPECS[2]))])
    drive(eng, {"r": ref}, rng, max_size=8)
    assert generated(eng, "r") == ref
    bad = [t for t in range(3, V) if not compiler.state(SPECS[2]).allows([t])][0]
    out = eng.open([OpenRequest("b", prompt, params, generated=(bad,), grammar=compiler.state(SPECS[2]))])
    assert isinstance(out[0], InvalidRequest) and "grammar" in out[0].message


def test_random_trees_never_emit_an_ungrammatical_token(tiny_model, compiler):
    """Trees of random tokens (mostly refused by the grammar): every emitted token still follows it."""
    rng = random.Random(3)
    V = tiny_model.config.vocab_size
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,))
    prompt = random_prompt(rng, V, 3, 10)
    eng.open([OpenRequest("x", prompt, SamplingParams(max_tokens=25), grammar=compiler.state(SPECS[4]))])
    from specdec.engine import VerifyRequest

    while not eng.sessions["x"].finished:
        s = eng.sessions["x"]
        eng.verify([VerifyRequest("x", random_tree(rng, [], V, 12, 4), len(s.prefix))])
    assert compiler.state(SPECS[4]).allows(generated(eng, "x"))


# -- sampled: the masked target's distribution, through trees --------------------------------------
STAT_VOCAB = ["a", "b", "c", "d", "e", "f", "g", "h"]  # the 8-token statistics model's ids, as text
# the second token's options depend on the first: a row masked with the wrong path state is visible
STAT_GRAMMAR = GrammarSpec("ebnf", 'root ::= "e" ("a" [b-d] | "b" [a-c] | "c" [e-g] | "d" "a" | [f-h] [a-h]) [a-h]*')


def _masked_joint(model, compiler) -> dict:
    from tests.specdec.test_engine import STAT_PROMPT, STAT_ROOT, V_STAT
    from specdec.sampling import target_probs

    params = SamplingParams(temperature=1.0)
    ctx = STAT_PROMPT + [STAT_ROOT]
    root = compiler.state(STAT_GRAMMAR)
    root.accept([STAT_ROOT])
    with torch.inference_mode():
        p1 = target_probs(root.apply(model(torch.tensor([ctx])).logits[0, -1:], DraftTree.empty())[0], params)
        joint = {}
        for a in range(V_STAT):
            if p1[a] == 0:
                continue
            after = compiler.state(STAT_GRAMMAR)
            after.accept([STAT_ROOT, a])
            lg = after.apply(model(torch.tensor([ctx + [a]])).logits[0, -1:], DraftTree.empty())[0]
            p2 = target_probs(lg, params)
            joint.update({(a, b): float(p1[a] * p2[b]) for b in range(V_STAT) if p2[b] > 0})
    return joint


def _sample_two_via_engine(model, compiler) -> dict:
    from tests.specdec.test_engine import STAT_PROMPT, STAT_ROOT, STAT_SESSIONS, stat_tree

    eng = VerifierEngine(model, eos_token_ids=())
    sids = [f"x{i}" for i in range(STAT_SESSIONS)]
    eng.open([OpenRequest(sid, STAT_PROMPT, SamplingParams(temperature=1.0, seed=i, max_tokens=8),
                          generated=(STAT_ROOT,), grammar=compiler.state(STAT_GRAMMAR)) for i, sid in enumerate(sids)])
    from specdec.engine import VerifyRequest

    reqs = [VerifyRequest(sid, stat_tree(model), len(STAT_PROMPT) + 1) for sid in sids]
    while reqs:
        eng.verify(reqs)
        reqs = [VerifyRequest(sid, DraftTree((1, 2), (-1, -1)), len(eng.sessions[sid].prefix))
                for sid in sids if eng.sessions[sid].num_generated < 3]
    counts: dict = {}
    for sid in sids:
        pair = tuple(generated(eng, sid)[1:3])
        counts[pair] = counts.get(pair, 0) + 1
    return counts


@pytest.fixture(scope="module")
def stat_compiler():
    return GrammarCompiler(list(STAT_VOCAB), len(STAT_VOCAB), ())


def test_sampled_tokens_through_trees_follow_the_masked_target(stat_compiler):
    from specdec.model.loading import tiny_random_model
    from tests.specdec.test_sampling import chi_square_pvalue

    model = tiny_random_model(seed=1, vocab_size=len(STAT_VOCAB))
    joint = _masked_joint(model, stat_compiler)
    counts = _sample_two_via_engine(model, stat_compiler)
    assert set(counts) <= set(joint)  # never an ungrammatical pair
    assert chi_square_pvalue(counts, joint) > 1e-3


def test_the_statistic_catches_masks_of_the_wrong_path_state(stat_compiler, monkeypatch):
    """Test of the test: every row masked with the root's state (the path ignored) fails it."""
    from specdec.grammar import GrammarState
    from specdec.model.loading import tiny_random_model
    from tests.specdec.test_sampling import chi_square_pvalue

    model = tiny_random_model(seed=1, vocab_size=len(STAT_VOCAB))
    joint = _masked_joint(model, stat_compiler)
    root_only = GrammarState.masks

    def wrong(self, tree):
        rows = root_only(self, DraftTree.empty())
        return rows.expand(len(tree) + 1, -1).clone()

    monkeypatch.setattr(GrammarState, "masks", wrong)
    monkeypatch.setattr(GrammarState, "accept", lambda self, tokens: None)  # (the wrong rows emit refused pairs)
    counts = _sample_two_via_engine(model, stat_compiler)
    refused = set(counts) - set(joint)  # pairs the grammar refuses: emitted only by the wrong masks
    assert refused or chi_square_pvalue(counts, joint) < 1e-6
