"""What prefix caching saves on multi-turn chat: MT-Bench's two turns, with and without it.

Each conversation is one MT-Bench question: turn 1 through the chat template, ``--max-tokens``
of greedy target output, then turn 2 (turn 1, that answer and the second question, through
the chat template) and its first token. Every conversation runs on two engines side by side
(the same weights in this process, one torch thread): ``verifier.prefix_caching`` off and on,
in alternating order. With it on, turn 1 finds the chat template's system prompt cached (from
the conversations before) and turn 2 finds turn 1 and the answer (a finished session's pages
stay cached).

Reported per mode: prompt tokens, those computed, the prefill's CPU seconds (the opening
thread's, :meth:`specdec.engine.VerifierEngine.open`) and its wall time (time to first
token at the engine), per turn; the answers of both modes must be the same tokens. Written to
``benchmarks/results/prefix-cache-<date>.json``. ``python -m benchmarks.prefix_cache``
(embedded SmolLM2, bf16, ~3 min on a 2-core AVX2 host).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("off", "on")


def conversations(n: int) -> list[list[str]]:
    """The first ``n`` MT-Bench questions' two turns."""
    from benchmarks.prompts import mtbench_turns

    return [turns[:2] for turns in mtbench_turns()[:n]]


def _open(engine, sid: str, prompt: list[int], params) -> tuple[dict, object]:
    from specdec.engine import OpenRequest

    hits = engine.prefix_tokens[1]
    t0, c0 = time.perf_counter(), time.thread_time()
    (res,) = engine.open([OpenRequest(sid, prompt, params)])
    cost = {"tokens": len(prompt), "cached": engine.prefix_tokens[1] - hits,
            "cpu_ms": 1e3 * (time.thread_time() - c0), "wall_ms": 1e3 * (time.perf_counter() - t0)}
    return cost, res


def _decode(engine, sid: str) -> list[int]:
    """Greedy target decoding (an empty tree per round) to the end; the generated tokens."""
    from specdec.engine import VerifyRequest
    from specdec.tree import DraftTree

    s = engine.sessions[sid]
    while not s.finished:
        engine.verify([VerifyRequest(sid, DraftTree.empty(), len(s.prefix))])
    return s.prefix[s.prompt_len:]


def run(model: str = "embedded", dtype: str = "auto", n: int = 10, max_tokens: int = 64) -> dict:
    import torch

    from specdec.engine import VerifierEngine
    from specdec.model.loading import load_model, load_tokenizer
    from specdec.sampling import SamplingParams
    from specdec.openai import chat_prompt

    torch.set_num_threads(1)
    lm = load_model(model, dtype=dtype)
    tok = load_tokenizer(model)
    engines = {m: VerifierEngine(lm.model, eos_token_ids=lm.eos_token_ids, prefix_caching=m == "on") for m in MODES}
    answer = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    first = SamplingParams(max_tokens=1, ignore_eos=True)
    costs: dict[str, dict[str, list[dict]]] = {m: {"turn1": [], "turn2": []} for m in MODES}
    convs = conversations(n)
    _open(engines["off"], "warm-up", chat_prompt([{"role": "user", "content": "Hi"}], tok), first)  # one-off costs
    for i, (q1, q2) in enumerate(convs):
        answers = {}
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            eng = engines[mode]
            turn1 = chat_prompt([{"role": "user", "content": q1}], tok)
            cost, _ = _open(eng, f"c{i}", turn1, answer)
            costs[mode]["turn1"].append(cost)
            answers[mode] = _decode(eng, f"c{i}")  # the first token and the rest
            eng.close(f"c{i}")
            text = tok.decode(answers[mode], skip_special_tokens=True)
            turn2 = chat_prompt([{"role": "user", "content": q1}, {"role": "assistant", "content": text},
                                 {"role": "user", "content": q2}], tok)
            cost, _ = _open(eng, f"c{i}-2", turn2, first)
            costs[mode]["turn2"].append(cost)
            eng.close(f"c{i}-2")
        if answers["on"] != answers["off"]:
            raise AssertionError(f"conversation {i}: prefix caching changed the answer")
    summary = {}
    for mode in MODES:
        for turn, cs in costs[mode].items():
            summary[f"{mode}/{turn}"] = {
                "prompt_tokens": sum(c["tokens"] for c in cs), "cached_tokens": sum(c["cached"] for c in cs),
                "prefill_cpu_ms_mean": statistics.mean(c["cpu_ms"] for c in cs),
                "ttft_ms_mean": statistics.mean(c["wall_ms"] for c in cs)}
    return {"conditions": {"model": lm.name, "dtype": str(lm.dtype).replace("torch.", ""), "conversations": len(convs),
                           "max_tokens": max_tokens, "threads": 1, "cpu_affinity": sorted(os.sched_getaffinity(0)),
                           "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "note": "engine in-process (no Ray); turn 2 = turn 1 + the greedy answer + question 2; "
                                   "modes alternate per conversation"},
            "summary": summary, "costs": costs}


def table(result: dict) -> str:
    s = result["summary"]
    lines = ["| turn | prompt tokens | cached off / on | prefill CPU ms off | on | x | TTFT ms off | on |",
             "|---|---|---|---|---|---|---|---|"]
    for turn in ("turn1", "turn2"):
        off, on = s[f"off/{turn}"], s[f"on/{turn}"]
        lines.append(f"| {turn} | {on['prompt_tokens']} | {off['cached_tokens']} / {on['cached_tokens']} | "
                     f"{off['prefill_cpu_ms_mean']:.0f} | {on['prefill_cpu_ms_mean']:.0f} | "
                     f"x{off['prefill_cpu_ms_mean'] / max(on['prefill_cpu_ms_mean'], 1e-9):.2f} | "
                     f"{off['ttft_ms_mean']:.0f} | {on['ttft_ms_mean']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--conversations", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/prefix-cache-<date>.json)")
    args = ap.parse_args(argv)
    result = run(args.model, args.dtype, args.conversations, args.max_tokens)
    print(json.dumps(result["conditions"]))
    print(table(result))
    out = Path(args.out) if args.out else RESULTS / f"prefix-cache-{time.strftime('%Y%m%d')}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
