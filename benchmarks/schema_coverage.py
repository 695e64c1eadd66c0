"""Structured output over real-world JSON schemas (issue 63): each schema compiled or refused with a
400 naming why, a constrained generation of each compiled one through the verifier engine, and every
completed output parsed and validated (``jsonschema``). Coverage: compiled / refused / finished /
valid / finished by length.

    git clone https://github.com/guidance-ai/jsonschemabench /tmp/jsonschemabench
    python -m benchmarks.schema_coverage --schemas /tmp/jsonschemabench/data --count 240

Schemas are drawn evenly from the data's subsets (seeded). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from collections import Counter
from pathlib import Path


def pick(root: Path, count: int, seed: int) -> list[Path]:
    """``count`` schema files, as evenly over ``root``'s subsets as they allow (seeded)."""
    rng = random.Random(seed)
    subsets = {d.name: sorted(d.glob("*.json")) for d in sorted(root.iterdir()) if d.is_dir()}
    subsets = {k: v for k, v in subsets.items() if v}
    for files in subsets.values():
        rng.shuffle(files)
    out, i = [], 0
    while len(out) < count and any(i < len(v) for v in subsets.values()):
        out += [v[i] for v in subsets.values() if i < len(v)][: count - len(out)]
        i += 1
    return out


def validate(doc_text: str, schema: dict) -> str | None:
    """None when ``doc_text`` parses and follows ``schema``; else why not."""
    import jsonschema

    try:
        doc = json.loads(doc_text)
    except ValueError as e:
        return f"not JSON: {e}"
    try:
        cls = jsonschema.validators.validator_for(schema)
        errors = sorted(cls(schema).iter_errors(doc), key=str)
    except Exception as e:  # a schema jsonschema itself cannot use (remote $ref, bad regex dialect)
        return f"unvalidatable: {type(e).__name__}"
    return f"invalid: {errors[0].message[:120]}" if errors else None


def run(args) -> dict:
    import torch

    from specdec.engine import OpenRequest, VerifierEngine, VerifyRequest
    from specdec.errors import InvalidRequest
    from specdec.grammar import GrammarCompiler, GrammarSpec
    from specdec.model.loading import load_model
    from specdec.sampling import SamplingParams
    from specdec.tree import DraftTree

    lm = load_model(args.model, dtype=args.dtype, device="cpu")
    torch.set_num_threads(1)
    compiler = GrammarCompiler(lm.tokenizer, lm.model.config.vocab_size, lm.eos_token_ids)
    engine = VerifierEngine(lm.model, eos_token_ids=lm.eos_token_ids, max_batch_tokens=4096)
    prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": "Reply with one JSON document."}],
                                              add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    rows, jobs = [], []
    for path in pick(Path(args.schemas), args.count, args.seed):
        row = {"schema": f"{path.parent.name}/{path.name}"}
        try:
            schema = json.loads(path.read_text())
            t0 = time.perf_counter()
            state = compiler.state(GrammarSpec("json_schema", json.dumps(schema)))
            row.update(compiled=True, compile_ms=1e3 * (time.perf_counter() - t0))
            jobs.append((row, schema, state))
        except (InvalidRequest, ValueError) as e:
            row.update(compiled=False, refusal=getattr(e, "message", str(e))[:160])
        rows.append(row)
    for start in range(0, len(jobs), args.batch):  # a batch of sessions decoded together (empty trees)
        batch = jobs[start:start + args.batch]
        sids = [f"s{start + i}" for i in range(len(batch))]
        res = engine.open([OpenRequest(sid, prompt, SamplingParams(max_tokens=args.max_tokens), grammar=state)
                           for sid, (_, _, state) in zip(sids, batch)])
        t0, live = time.perf_counter(), [sid for sid, r in zip(sids, res) if not r.finished]
        while live:
            engine.verify([VerifyRequest(sid, DraftTree.empty(), len(engine.sessions[sid].prefix)) for sid in live])
            live = [sid for sid in live if not engine.sessions[sid].finished]
        for sid, (row, schema, _) in zip(sids, batch):
            s = engine.sessions[sid]
            out = s.prefix[s.prompt_len:]
            row.update(finish=s.finish_reason, tokens=len(out))
            if s.finish_reason == "stop":
                text = lm.tokenizer.decode([t for t in out if t not in lm.eos_token_ids])
                row["problem"] = validate(text, schema)
            engine.close(sid)
        print(f"[schemas] {start + len(batch)}/{len(jobs)} generated ({time.perf_counter() - t0:.1f} s)", flush=True)
    return summarise(rows, args)


def _reason(refusal: str) -> str:
    """A refusal's keyword (``'oneOf' at #/...``: ``oneOf``), else its message's last part."""
    m = re.search(r"'(\$?\w+)' at #", refusal)
    return m.group(1) if m else refusal.split(":")[-1].strip()[:60]


def summarise(rows: list[dict], args) -> dict:
    compiled = [r for r in rows if r["compiled"]]
    stopped = [r for r in compiled if r.get("finish") == "stop"]
    valid = [r for r in stopped if r.get("problem") is None]
    invalid = [r for r in stopped if r.get("problem") and not r["problem"].startswith("unvalidatable")]
    figures = {"schemas": len(rows), "compiled": len(compiled), "refused": len(rows) - len(compiled),
               "finished": len(stopped), "valid": len(valid), "invalid": len(invalid),
               "unvalidatable": len(stopped) - len(valid) - len(invalid),
               "finished_by_length": sum(r.get("finish") == "length" for r in compiled),
               "compile_ms_p50": sorted(r["compile_ms"] for r in compiled)[len(compiled) // 2] if compiled else None,
               "refusals": Counter(_reason(r["refusal"]) for r in rows if not r["compiled"]).most_common(12)}
    return {"conditions": {"model": args.model, "dtype": args.dtype, "max_tokens": args.max_tokens,
                           "count": args.count, "seed": args.seed, "schemas": str(args.schemas),
                           "decoding": "greedy, the verifier engine with empty trees (one token a round)"},
            "figures": figures, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.schema_coverage", description=__doc__.split("\n")[0])
    ap.add_argument("--schemas", required=True, help="a directory of subsets of JSON schema files "
                                                     "(JSONSchemaBench's data/)")
    ap.add_argument("--count", type=int, default=240)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/results/schema_coverage.json")
    args = ap.parse_args(argv)
    out = run(args)
    f = out["figures"]
    print("| schemas | compiled | refused (400) | finished | valid | invalid | unvalidatable | by length |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {f['schemas']} | {f['compiled']} | {f['refused']} | {f['finished']} | {f['valid']} | {f['invalid']} | "
          f"{f['unvalidatable']} | {f['finished_by_length']} |")
    print("refusals:", f["refusals"])
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
