"""Train the embedded target's exit heads on its own outputs (early-exit paper §3, Fig. 3).

1. ``gen``: the target answers instruction prompts (``benchmarks.train_draft``'s templates,
   never the MT-Bench/HumanEval evaluation prompts), greedy and T = 0.8, batched bf16.
2. ``feats``: one forward per sequence with hidden states: for every response position, the
   residual stream after each exit layer and the final layer's top-32 next-token
   distribution (the distillation target; the exits are trained to agree with it).
3. ``train``: each exit's adapter (:class:`specdec.exit_heads.ExitAdapter`) alone,
   soft cross-entropy to the final top-32 restricted to the vocabulary subset (the paper
   backpropagates each exit's loss into its own adapter; the target stays frozen), AdamW.
4. held-out agreement (exit argmax == final argmax) for the trained head and for the
   untrained logit lens, per layer; the artifact ``deploy/artifacts/embedded-exit-heads.*``.

``nice -n 10 python -m benchmarks.train_exit_heads`` (a few minutes on 2 cores; ``make
exit-heads``). Work files go to ``.cache/exit_heads``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from benchmarks.train_draft import generate_batch, template_prompts
from specdec.exit_heads import ALIASES, ExitAdapter, ExitHeads

DEFAULT_LAYERS = (8, 12, 16, 20)


def gen(args, lm) -> list[dict]:
    tok, model = lm.tokenizer, lm.model
    rng = random.Random(args.seed)
    texts = template_prompts(rng)
    rng.shuffle(texts)
    texts = texts[: args.prompts]
    jobs = [(t, 0.0 if i % 2 == 0 else 0.8) for i, t in enumerate(texts)]
    enc = []
    for text, temp in jobs:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        enc.append((ids, temp))
    g = torch.Generator().manual_seed(args.seed)
    out, t0 = [], time.time()
    for b in range(0, len(enc), args.gen_batch):
        batch = enc[b: b + args.gen_batch]
        res = generate_batch(model, [p for p, _ in batch], [t for _, t in batch], args.max_new_tokens, 8,
                             set(lm.eos_token_ids), g)
        out += [{"prompt": p, "response": r[0], "heldout": (b + j) % 10 == 0} for j, ((p, _), r) in
                enumerate(zip(batch, res))]
        print(f"gen {len(out)}/{len(enc)} prompts, {sum(len(s['response']) for s in out)} tokens, "
              f"{time.time() - t0:.0f} s", flush=True)
    return out


@torch.inference_mode()
def feats(samples: list[dict], lm, layers, top_k: int = 32) -> dict:
    """Per response position: hidden after each exit layer [T, D] (bf16) and the final top-k."""
    model = lm.model
    H = {x: [] for x in layers}
    tid, tlp, held = [], [], []
    for s in samples:
        ids = torch.tensor([s["prompt"] + s["response"]])
        out = model(input_ids=ids, output_hidden_states=True)
        p0 = len(s["prompt"]) - 1  # the row predicting the first response token
        sl = slice(p0, ids.shape[1] - 1)
        for x in layers:
            H[x].append(out.hidden_states[x][0, sl].to(torch.bfloat16))
        lp = torch.log_softmax(out.logits[0, sl].float(), -1)
        v, i = lp.topk(top_k, -1)
        tid.append(i.to(torch.int32))
        tlp.append(v.to(torch.float16))
        held.append(torch.full((sl.stop - sl.start,), s["heldout"]))
    return {"h": {x: torch.cat(v) for x, v in H.items()}, "ids": torch.cat(tid), "logp": torch.cat(tlp),
            "heldout": torch.cat(held)}


def select_ids(data: dict, size: int, special: list[int], vocab: int) -> torch.Tensor:
    """The ``size`` ids with the most final-layer top-k probability mass on training rows."""
    tr = ~data["heldout"]
    score = torch.zeros(vocab, dtype=torch.float64)
    score.index_add_(0, data["ids"][tr].long().flatten(), data["logp"][tr].double().exp().flatten())
    score[torch.tensor(special, dtype=torch.long)] = float("inf")
    return score.topk(size).indices.sort().values


def soft_targets(data: dict, ids: torch.Tensor, vocab: int):
    """Final top-k mapped into subset positions (-1 outside), their probabilities renormalised."""
    inv = torch.full((vocab,), -1, dtype=torch.long)
    inv[ids] = torch.arange(len(ids))
    pos = inv[data["ids"].long()]  # [T, k]
    p = data["logp"].float().exp() * (pos >= 0)
    return pos.clamp(min=0), p / p.sum(-1, keepdim=True).clamp(min=1e-9), inv


def train(args, lm, data) -> dict:
    model = lm.model
    cfg = model.config
    layers = tuple(args.layers)
    ids = select_ids(data, args.vocab, list(lm.eos_token_ids) + [0, 1, 2], cfg.vocab_size)
    pos, prob, _inv = soft_targets(data, ids, cfg.vocab_size)
    final_arg = data["ids"][:, 0].long()
    heads = ExitHeads.init(model, layers, rank=args.rank, ids=ids)
    for a in heads.adapters.values():
        a.to(torch.float32)
    W = heads.head.float()  # [K, D]
    fn = heads.final_norm.float()
    tr_idx = (~data["heldout"]).nonzero().squeeze(1)
    ho_idx = data["heldout"].nonzero().squeeze(1)
    rng = torch.Generator().manual_seed(args.seed)

    def exit_logits(a: ExitAdapter, h: torch.Tensor) -> torch.Tensor:
        z = a(h.float(), heads.eps)
        zf = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + heads.eps) * fn
        return zf @ W.t()  # [B, K]

    def agreement(x: int, a: ExitAdapter | None) -> float:
        hits = 0
        for b in range(0, len(ho_idx), 1024):
            r = ho_idx[b: b + 1024]
            h = data["h"][x][r].float()
            if a is None:  # the logit lens: final norm + head on the layer's residual stream
                zf = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + heads.eps) * fn
                lg = zf @ W.t()
            else:
                with torch.no_grad():
                    lg = exit_logits(a, h)
            hits += int((ids[lg.argmax(-1)] == final_arg[r]).sum())
        return hits / max(len(ho_idx), 1)

    report = {}
    t0 = time.time()
    for x in layers:
        a = heads.adapters[x]
        opt = torch.optim.AdamW(a.parameters(), lr=args.lr, weight_decay=0.0)
        lens = agreement(x, None)
        steps = args.epochs * max(1, len(tr_idx) // args.batch)
        for step in range(steps):
            r = tr_idx[torch.randint(len(tr_idx), (args.batch,), generator=rng)]
            lg = exit_logits(a, data["h"][x][r])
            logq = torch.log_softmax(lg, -1)
            loss = -(prob[r] * logq.gather(-1, pos[r])).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            for gr in opt.param_groups:  # cosine decay
                gr["lr"] = args.lr * 0.5 * (1 + torch.cos(torch.tensor(3.14159 * (step + 1) / steps))).item()
        agree = agreement(x, a)
        report[x] = {"heldout_agreement": round(agree, 4), "logit_lens_agreement": round(lens, 4),
                     "final_loss": round(float(loss), 4), "steps": steps}
        print(f"exit {x}: held-out agreement {agree:.3f} (logit lens {lens:.3f}), loss {float(loss):.3f}, "
              f"{time.time() - t0:.0f} s", flush=True)
    cover = float((torch.isin(final_arg[ho_idx], ids)).float().mean())
    meta = {"target": lm.name, "rank": args.rank, "vocab_subset": len(ids), "heldout_argmax_in_subset": round(cover, 4),
            "train_tokens": int(len(tr_idx)), "heldout_tokens": int(len(ho_idx)), "epochs": args.epochs,
            "lr": args.lr, "per_layer": {str(k): v for k, v in report.items()}, "trained": True,
            "train_seconds": round(time.time() - t0, 1)}
    heads.save(args.out, meta)
    print(json.dumps(meta, indent=2))
    return meta


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=list(DEFAULT_LAYERS))
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=192)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=".cache/exit_heads")
    ap.add_argument("--out", default=str(ALIASES["embedded"]))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from specdec.model.loading import load_model

    lm = load_model("embedded", dtype="bfloat16")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    key = f"{args.prompts}-{args.max_new_tokens}-{args.seed}"
    samples_f = work / f"samples-{key}.pt"
    if samples_f.exists():
        samples = torch.load(samples_f, weights_only=False)
    else:
        samples = gen(args, lm)
        torch.save(samples, samples_f)
    feats_f = work / f"feats-{key}-{'_'.join(map(str, sorted(args.layers)))}.pt"
    if feats_f.exists():
        data = torch.load(feats_f, weights_only=False)
    else:
        t0 = time.time()
        data = feats(samples, lm, sorted(args.layers))
        torch.save(data, feats_f)
        print(f"features: {len(data['ids'])} positions in {time.time() - t0:.0f} s", flush=True)
    train(args, lm, data)


if __name__ == "__main__":
    main()
