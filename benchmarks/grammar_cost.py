"""What a grammar costs a verify round (issue 63): mask time per tree node, and the engine's round time
with and without a grammar at 1 and 16 sessions, side by side in one run; then tokens per round of edge
generations (the embedded draft against the embedded target) with and without the edge's own masking.

    python -m benchmarks.grammar_cost [--model embedded] [--nodes 16] [--rounds 20] [--prompts 4]

Each round verifies a draft tree of ``--nodes`` nodes per session (two children a level, a chain
below each; with the grammar every token grammatical after its path, so the mask pass visits every
node), greedy, one CPU thread. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}


def grammatical_tree(state, n: int, rng):
    """A tree of ``n`` nodes (two children a level, a chain below each) whose every token the grammar
    allows after its path: what a masked edge drafts, and the most a mask pass visits."""
    from specdec.grammar import allowed
    from specdec.tree import DraftTree

    tokens, parents = [], []
    for i in range(n):
        parent = -1 if i < 2 else i - 2
        path, node = [], parent
        while node >= 0:
            path.append(tokens[node])
            node = parents[node]
        words = state.words_after(path[::-1])
        ids = [] if words is None else [t for t in range(state.vocab_size) if allowed(words, t)
                                        and t not in state.matcher.stop_token_ids]
        tokens.append(rng.choice(ids) if ids else rng.randrange(256))
        parents.append(parent)
    return DraftTree(tuple(tokens), tuple(parents))


def run(args) -> dict:
    import torch

    from specdec.engine import OpenRequest, VerifierEngine, VerifyRequest
    from specdec.grammar import GrammarCompiler, GrammarSpec
    from specdec.model.loading import load_model
    from specdec.sampling import SamplingParams
    from specdec.tree import DraftTree

    torch.set_num_threads(1)
    rng = random.Random(0)
    lm = load_model(args.model, dtype=args.dtype, device="cpu")
    compiler = GrammarCompiler(lm.tokenizer, lm.model.config.vocab_size, lm.eos_token_ids)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": "A person as JSON."}],
                                              add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    rows = []
    for sessions in (1, 16):
        for grammar in (False, True):
            eng = VerifierEngine(lm.model, eos_token_ids=lm.eos_token_ids)
            sids = [f"s{i}" for i in range(sessions)]
            eng.open([OpenRequest(sid, prompt, SamplingParams(max_tokens=4096, ignore_eos=True),
                                  grammar=compiler.state(spec) if grammar else None) for sid in sids])
            round_s, mask_s, nodes = [], 0.0, 0
            for r in range(args.rounds):
                reqs = []
                for sid in sids:
                    s = eng.sessions[sid]
                    if grammar:
                        tree = grammatical_tree(s.grammar, args.nodes, rng)
                    else:
                        tree = DraftTree(tuple(rng.randrange(256) for _ in range(args.nodes)),
                                         tuple(-1 if i < 2 else i - 2 for i in range(args.nodes)))
                    if grammar:  # the masks alone, timed apart (the engine computes them again in the round)
                        t0 = time.perf_counter()
                        s.grammar.masks(tree)
                        mask_s += time.perf_counter() - t0
                        nodes += len(tree) + 1
                    reqs.append(VerifyRequest(sid, tree, len(s.prefix)))
                t0 = time.perf_counter()
                eng.verify(reqs)
                round_s.append(time.perf_counter() - t0)
            round_s = sorted(round_s[2:])  # the first rounds warm caches
            rows.append({"sessions": sessions, "grammar": grammar, "nodes": args.nodes,
                         "round_ms_p50": 1e3 * round_s[len(round_s) // 2],
                         "mask_us_per_node": 1e6 * mask_s / nodes if nodes else None})
    by = {(r["sessions"], r["grammar"]): r for r in rows}
    for s in (1, 16):
        by[(s, True)]["added_round_time"] = by[(s, True)]["round_ms_p50"] / by[(s, False)]["round_ms_p50"] - 1
    return {"conditions": {"model": args.model, "dtype": args.dtype, "nodes_per_tree": args.nodes,
                           "rounds": args.rounds, "schema": SCHEMA, "threads": 1, "device": "cpu"}, "rows": rows}


PROMPTS = ["A person as JSON.", "Describe a user of a web shop as JSON.", "Give me a JSON record of a book author.",
           "Return a JSON object for a football player."]


def edge_masking(args) -> list[dict]:
    """Edge generations (greedy, the embedded draft in a proactive agent at a fixed depth of 4, so both arms draft
    trees of one shape; the engine in this process) under the schema, with the edge's GrammarDrafter and with its
    plain drafter: tokens per round and drafted tokens accepted per round."""
    import asyncio

    import torch

    from edge_agent.agent import EdgeAgent, encode_prompt
    from edge_agent.config import AgentConfig
    from edge_agent.draft_backends import ModelDrafter
    from edge_agent.embedded_draft import load_draft
    from edge_agent.transport.local import LocalTransport
    from specdec.engine import VerifierEngine
    from specdec.grammar import GrammarSpec
    from specdec.model.loading import load_model
    from specdec.sampling import SamplingParams

    class Unmasked(EdgeAgent):  # the verifier still masks the target; only the drafts ignore the grammar
        def _drafter_for(self, grammar, info, prompt_len):
            return self.drafter

    torch.set_num_threads(1)
    lm = load_model(args.model, dtype=args.dtype, device="cpu")
    draft = ModelDrafter(load_draft(None, "embedded-draft", dtype=args.dtype), name="embedded-draft")
    spec, rows = GrammarSpec("json_schema", json.dumps(SCHEMA)), []
    for masked in (True, False):
        eng = VerifierEngine(lm.model, eos_token_ids=lm.eos_token_ids)
        tokens = rounds = accepted = 0
        for text in PROMPTS[:args.prompts]:
            agent = (EdgeAgent if masked else Unmasked)(LocalTransport(eng, tokenizer=lm.tokenizer), draft,
                                                         tokenizer=lm.tokenizer,
                                                         config=AgentConfig(mode="proactive", depth_policy="fixed"))
            res = asyncio.run(agent.generate(encode_prompt(lm.tokenizer, text, chat=True),
                                             SamplingParams(max_tokens=args.max_tokens), grammar=spec))
            agent.close()
            tokens, rounds = tokens + res.stats.round_tokens, rounds + res.stats.rounds
            accepted += res.stats.mean_accepted * res.stats.rounds
        rows.append({"edge_masking": masked, "prompts": args.prompts, "rounds": rounds,
                     "tokens_per_round": tokens / max(rounds, 1), "drafted_accepted_per_round": accepted / max(rounds, 1)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.grammar_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=4, help="edge generations per arm (0: skip that part)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default="benchmarks/results/grammar_cost.json")
    args = ap.parse_args(argv)
    out = run(args)
    out["edge_masking"] = edge_masking(args) if args.prompts else []
    print("| sessions | grammar | round p50 (ms) | added round time | mask time per node (us) |")
    print("|---|---|---|---|---|")
    for r in out["rows"]:
        added = f"{100 * r['added_round_time']:+.1f} %" if "added_round_time" in r else "-"
        mask = f"{r['mask_us_per_node']:.1f}" if r["mask_us_per_node"] else "-"
        print(f"| {r['sessions']} | {'yes' if r['grammar'] else 'no'} | {r['round_ms_p50']:.1f} | {added} | {mask} |")
    if out["edge_masking"]:
        print("| edge masking | rounds | tokens per round | drafted tokens accepted per round |")
        print("|---|---|---|---|")
        for r in out["edge_masking"]:
            print(f"| {'yes' if r['edge_masking'] else 'no'} | {r['rounds']} | {r['tokens_per_round']:.2f} | "
                  f"{r['drafted_accepted_per_round']:.2f} |")
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
