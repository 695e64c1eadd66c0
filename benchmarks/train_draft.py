"""Build the embedded draft for SmolLM2-135M-Instruct by self-distillation, on CPU.

A one-off, reproducible build (its result is committed as ``edge_agent/artifacts/
embedded-draft.*``; see :mod:`edge_agent.embedded_draft` for the architecture):

1. ``gen``: the target writes the training text itself. Prompts are instruction
   templates over seed topics (writing, roleplay, reasoning, math, coding, extraction,
   STEM, humanities) plus, when given, the non-MT-Bench Spec-Bench categories
   (translation, summarization, QA, math reasoning, RAG). Never the MT-Bench or
   HumanEval evaluation prompts. Batched bf16 decoding, greedy and T=0.8; for every
   response token the target's top-k log-probs are stored (the KD targets, free).
2. ``vocab``: the draft head's vocabulary = the ``V'`` target tokens with the most
   occurrence + top-k probability mass in the generated text (plus special tokens).
3. ``train``: KD, ``KL(target || draft)`` on the target's top-k restricted to ``V'``
   (soft cross-entropy), AdamW lr 1e-3 with cosine decay, within a time budget. The
   draft's layers start from the target's (keep the last layer: ENVIRONMENT.md trials).
4. the artifact (trainable tensors in bf16 + vocab_map) and a JSON of what was done.

Budgets are wall-clock, so the build fits its time on any machine:
``python -m benchmarks.train_draft`` (defaults: 60 min generation + 45 min training on
2 cores; ``--gen-minutes``, ``--train-minutes``, ``--layers``, ``--vocab``,
``--specbench PATH``, ``--stage``). Generated data goes to ``.cache/draft_build``.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import time
from pathlib import Path

import torch

# -- prompts -----------------------------------------------------------------------

TOPICS = [
    "the ocean", "climate change", "a small bakery", "space exploration", "ancient Rome", "machine learning",
    "a rainy city", "friendship", "the Renaissance", "electric cars", "coffee", "a lost dog", "volcanoes",
    "the human heart", "chess", "a mountain village", "social media", "honeybees", "the French Revolution",
    "quantum computers", "gardening", "a job interview", "the moon landing", "recycling", "jazz music",
    "a haunted house", "photosynthesis", "the stock market", "a robot chef", "the Silk Road", "sleep",
    "video games", "a first day at school", "black holes", "vaccines", "the Amazon rainforest", "time travel",
    "a family reunion", "renewable energy", "the printing press", "yoga", "a detective", "earthquakes",
    "online privacy", "dinosaurs", "a marathon", "democracy", "the internet", "a pirate ship", "nutrition",
    "Shakespeare", "smartphones", "a wedding", "glaciers", "public transport", "the Olympic Games",
    "a startup company", "meditation", "the water cycle", "a museum", "inflation", "volunteering",
    "the Great Wall of China", "artificial intelligence ethics", "a thunderstorm", "teamwork", "bicycles",
]

TEMPLATES = [
    # writing / roleplay
    "Write a short story about {t}.", "Write a poem about {t}.", "Write a persuasive essay about {t}.",
    "Compose a blog post about {t}, with a catchy title.", "Write a professional email about {t}.",
    "Imagine you are a tour guide. Describe {t} to a group of visitors.",
    "Pretend you are a famous scientist being interviewed about {t}. Answer the first question.",
    "Write a dialogue between two friends discussing {t}.", "Write a product description inspired by {t}.",
    "Write a speech for a graduation ceremony that uses {t} as a metaphor.",
    # reasoning / stem / humanities
    "Explain {t} to a ten-year-old.", "What are the pros and cons of {t}?",
    "Give three interesting facts about {t} and explain why each matters.",
    "Describe the history of {t} in a few paragraphs.", "How does {t} affect everyday life?",
    "Compare {t} with something similar and explain the differences.",
    "What would happen if {t} disappeared tomorrow? Reason step by step.",
    "Summarize the main ideas someone should know about {t}.", "List five questions a student might ask about {t}, "
    "then answer them.", "Write a lesson plan for teaching {t} to high school students.",
    # extraction
    "Extract the key facts from this text and return them as JSON: '{t} has been studied by many people. "
    "Experts in 2019 and 2021 published reports with different conclusions.'",
    "Create a table with three columns (name, description, importance) about {t}.",
]

MATH_CODE = [
    "What is {a} times {b}? Show your work.", "Solve for x: {a}x + {b} = {c}.",
    "A shop sells apples for {a} cents each. How much do {b} apples cost in dollars?",
    "If a train travels {a} km in {b} hours, what is its average speed?",
    "What is the sum of all integers from 1 to {a}?", "Is {c} a prime number? Explain.",
    "Find the area of a rectangle with sides {a} cm and {b} cm, then its perimeter.",
    "Write a Python function that returns the {a}th Fibonacci number.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that sorts a list of {a} numbers without using sort().",
    "Write a JavaScript function that counts the vowels in a string.",
    "Write a SQL query that finds the {a} most expensive products in a table named products.",
    "Explain what this Python code does: `print(sum(i * i for i in range({a})))`.",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "Write a C function that reverses an array of {a} integers in place.",
    "Write a Python function that merges two sorted lists.",
]


def template_prompts(rng: random.Random) -> list[str]:
    out = [tpl.format(t=t) for tpl in TEMPLATES for t in TOPICS]
    for tpl in MATH_CODE:
        for _ in range(12):
            a, b = rng.randint(2, 99), rng.randint(2, 60)
            out.append(tpl.format(a=a, b=b, c=rng.randint(2, 500)))
    return out


def specbench_prompts(path: str | None) -> list[str]:
    """Single-turn prompts of the Spec-Bench categories that are not MT-Bench's."""
    if not path or not os.path.exists(path):
        return []
    mtbench = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    out = []
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            if d["category"] not in mtbench:
                out.append(d["turns"][0])
    return out


# -- generation ----------------------------------------------------------------------


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], temps: list[float], max_new: int, top_k: int,
                   eos: set[int], gen: torch.Generator):
    """Batched decoding that drops finished rows; returns per row (response ids, topk ids, topk logp)."""
    from transformers import DynamicCache

    B = len(prompts)
    P = max(len(p) for p in prompts)
    ids = torch.full((B, P), 2, dtype=torch.long)
    am = torch.zeros(B, P, dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding
        ids[b, P - len(p):] = torch.tensor(p)
        am[b, P - len(p):] = 1
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=am, position_ids=pos, past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    rows = torch.arange(B)  # original row of each live batch slot
    temp = torch.tensor(temps, dtype=torch.float32)
    resp: list[list[int]] = [[] for _ in range(B)]
    tk_ids: list[list[torch.Tensor]] = [[] for _ in range(B)]
    tk_lp: list[list[torch.Tensor]] = [[] for _ in range(B)]
    last_pos = pos[:, -1]
    for step in range(max_new):
        logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)  # [b, V]
        lp, ix = logp.topk(top_k, dim=-1)  # [b, k]
        t = temp[rows]
        greedy = logp.argmax(-1)
        probs = torch.softmax(logp / t.clamp(min=1e-3)[:, None], dim=-1)
        sampled = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        nxt = torch.where(t > 0, sampled, greedy)  # [b]
        keep = []
        for j, r in enumerate(rows.tolist()):
            resp[r].append(int(nxt[j]))
            tk_ids[r].append(ix[j].to(torch.int32))
            tk_lp[r].append(lp[j].to(torch.float16))
            if int(nxt[j]) not in eos:
                keep.append(j)
        if not keep or step == max_new - 1:
            break
        if len(keep) < len(rows):
            k = torch.tensor(keep)
            cache.batch_select_indices(k)
            rows, am, nxt, last_pos = rows[k], am[k], nxt[k], last_pos[k]
        am = torch.cat([am, torch.ones(len(rows), 1, dtype=torch.long)], dim=1)
        last_pos = last_pos + 1
        out = model(input_ids=nxt[:, None], attention_mask=am, position_ids=last_pos[:, None],
                    past_key_values=cache, use_cache=True)
    return [(resp[b], torch.stack(tk_ids[b]), torch.stack(tk_lp[b])) for b in range(B)]


def stage_gen(args) -> None:
    from specdec.model.loading import load_model

    work = Path(args.work)
    (work / "data").mkdir(parents=True, exist_ok=True)
    lm = load_model("embedded", dtype="bfloat16")
    tok, model = lm.tokenizer, lm.model
    rng = random.Random(args.seed)
    texts = template_prompts(rng) + specbench_prompts(args.specbench)
    jobs = [(t, 0.0) for t in texts] + [(t, args.temperature) for t in texts]
    rng.shuffle(jobs)
    max_prompt = args.max_prompt_tokens
    enc = []
    for text, temp in jobs:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if len(ids) > max_prompt:  # keep the instruction at the end of long documents
            ids = ids[:8] + ids[-(max_prompt - 8):]
        enc.append((ids, temp))
    done = len(glob.glob(str(work / "data" / "shard_*.pt")))
    # resuming: skip the (prompt, temperature) jobs earlier shards already hold
    have = {(tuple(s["prompt"]), s["temp"]) for s in load_shards(work)}
    gen = torch.Generator().manual_seed(args.seed + done)
    t0 = time.time()
    ntok = 0
    B = args.gen_batch
    # batches of similar prompt length (sorted within windows of 8 batches) waste less padding
    order = [i for i in range(len(enc)) if (tuple(enc[i][0]), enc[i][1]) not in have]
    batches = []
    for w in range(0, len(order), 8 * B):
        win = sorted(order[w:w + 8 * B], key=lambda i: len(enc[i][0]))
        batches += [win[i:i + B] for i in range(0, len(win), B)]
    rng.shuffle(batches)
    for bi, batch in enumerate(batches):
        if time.time() - t0 > args.gen_minutes * 60:
            break
        res = generate_batch(model, [enc[i][0] for i in batch], [enc[i][1] for i in batch], args.max_new_tokens,
                             args.top_k, set(lm.eos_token_ids), gen)
        shard = [{"prompt": enc[i][0], "response": r, "topk_ids": ti, "topk_logp": tl, "temp": enc[i][1]}
                 for i, (r, ti, tl) in zip(batch, res)]
        ntok += sum(len(r[0]) for r in res)
        torch.save(shard, work / "data" / f"shard_{done + bi:05d}.pt")
        el = time.time() - t0
        print(f"gen batch {bi} prompts {len(batch)} tokens {ntok} {ntok / el:.0f} tok/s {el / 60:.1f} min", flush=True)
    print(f"gen done: {ntok} tokens in {(time.time() - t0) / 60:.1f} min", flush=True)
    with open(work / "gen_log.jsonl", "a") as f:  # the artifact's meta reports every generation run
        f.write(json.dumps({"response_tokens": ntok, "minutes": round((time.time() - t0) / 60, 1),
                            "gen_batch": B, "gen_minutes": args.gen_minutes, "threads": args.threads,
                            "loadavg_end": os.getloadavg()}) + "\n")


# -- data -------------------------------------------------------------------------------


def load_shards(work: Path) -> list[dict]:
    out = []
    for f in sorted(glob.glob(str(work / "data" / "shard_*.pt"))):
        out += torch.load(f, weights_only=False)
    return out


def select_vocab(samples: list[dict], size: int, special: list[int]) -> torch.Tensor:
    """Top-``size`` target ids by occurrences + top-k probability mass in generated text."""
    V = 49152
    score = torch.zeros(V, dtype=torch.float64)
    for s in samples:
        score.index_add_(0, torch.tensor(s["response"]), torch.ones(len(s["response"]), dtype=torch.float64))
        score.index_add_(0, s["topk_ids"].long().flatten(), s["topk_logp"].double().exp().flatten())
        score.index_add_(0, torch.tensor(s["prompt"]), torch.full((len(s["prompt"]),), 0.1, dtype=torch.float64))
    score[torch.tensor(special)] = float("inf")
    return score.topk(size).indices.sort().values


def split(samples: list[dict], heldout_frac: float, seed: int):
    idx = list(range(len(samples)))
    random.Random(seed).shuffle(idx)
    n = max(1, int(len(idx) * heldout_frac))
    return [samples[i] for i in idx[n:]], [samples[i] for i in idx[:n]]


def make_batches(samples: list[dict], inv: torch.Tensor, max_len: int, batch_tokens: int, rng: random.Random):
    """Pack sequences (prompt tail + response) into [B, T] batches with KD targets.

    Returns lists of (input_ids [B, T], topk draft ids [B, T, k] (-1 = outside V'),
    topk probs [B, T, k], mask [B, T]); row t's targets are for the token at t + 1.
    """
    seqs = []
    for s in samples:
        p, r = s["prompt"], s["response"]
        keep_p = min(len(p), max(16, max_len - len(r)))
        ids = p[-keep_p:] + r
        ids = ids[:max_len + 1]
        n_resp = len(ids) - keep_p
        seqs.append((ids, keep_p, s["topk_ids"][:n_resp], s["topk_logp"][:n_resp]))
    rng.shuffle(seqs)
    seqs.sort(key=lambda x: len(x[0]) // 64)  # length buckets, shuffled inside
    batches, cur = [], []
    for sq in seqs:
        cur.append(sq)
        T = max(len(x[0]) for x in cur)
        if T * len(cur) >= batch_tokens:
            batches.append(cur)
            cur = []
    if cur:
        batches.append(cur)
    out = []
    for bt in batches:
        B, T = len(bt), max(len(x[0]) for x in bt) - 1
        k = bt[0][2].shape[1]
        inp = torch.full((B, T), 2, dtype=torch.long)
        tid = torch.full((B, T, k), -1, dtype=torch.long)
        tpr = torch.zeros(B, T, k)
        msk = torch.zeros(B, T, dtype=torch.bool)
        for b, (ids, kp, ti, tl) in enumerate(bt):
            n = len(ids) - 1
            inp[b, :n] = torch.tensor(ids[:-1])
            # the response token at ids[kp + j] is predicted from row kp + j - 1
            m = ti.shape[0]
            rows = slice(kp - 1, kp - 1 + m)
            tid[b, rows] = inv[ti.long()]
            tpr[b, rows] = tl.float().exp()
            msk[b, rows] = True
        out.append((inp, tid, tpr, msk))
    rng.shuffle(out)
    return out


def kd_loss(logits: torch.Tensor, tid: torch.Tensor, tpr: torch.Tensor, msk: torch.Tensor):
    """Soft cross-entropy to the target's top-k restricted to V' (= KL up to a constant).

    logits [B, T, V'], tid [B, T, k] draft ids (-1 outside V'), tpr [B, T, k], msk [B, T].
    Returns (loss, top-1 agreement count, positions).
    """
    logq = torch.log_softmax(logits.float(), dim=-1)  # [B, T, V']
    valid = (tid >= 0) & msk[..., None]
    p = tpr * valid
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-6)  # renormalised over the covered top-k
    lq = logq.gather(-1, tid.clamp(min=0))  # [B, T, k]
    n = msk.sum().clamp(min=1)
    loss = -(p * lq).sum(-1)[msk].sum() / n
    top1 = (logits.argmax(-1) == tid[..., 0]) & msk & (tid[..., 0] >= 0)
    return loss, int(top1.sum()), int(msk.sum())


# -- training ---------------------------------------------------------------------------


def stage_train(args) -> None:
    from edge_agent.embedded_draft import build_draft, save_artifact
    from specdec.model.loading import load_model, tokenizer_fingerprint

    torch.manual_seed(args.seed)
    work = Path(args.work)
    samples = load_shards(work)
    train, held = split(samples, args.heldout_frac, args.seed)
    lm = load_model("embedded", dtype="float32")
    target = lm.model
    special = sorted(set(lm.eos_token_ids) | set(range(0, 17)))
    vocab_map = select_vocab(train, args.vocab, special)
    inv = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    inv[vocab_map] = torch.arange(vocab_map.numel())
    n_train = sum(len(s["response"]) for s in train)
    cover = sum(int((inv[torch.tensor(s["response"])] >= 0).sum()) for s in held)
    n_held = sum(len(s["response"]) for s in held)
    print(f"data: {len(train)} train seqs ({n_train} tokens), {len(held)} held-out ({n_held} tokens); "
          f"V'={vocab_map.numel()} covers {cover / max(1, n_held):.4f} of held-out tokens", flush=True)

    layers = [int(x) for x in args.layers.split(",")]
    sd = target.state_dict()
    state = {}
    for i, src in enumerate(layers):
        for k, v in sd.items():
            if k.startswith(f"model.layers.{src}."):
                state[k.replace(f"model.layers.{src}.", f"model.layers.{i}.")] = v
    state["model.norm.weight"] = sd["model.norm.weight"]
    draft = build_draft(target.config, sd["model.embed_tokens.weight"], vocab_map, len(layers), state)
    tok = lm.tokenizer
    del target, lm, sd
    draft.train()
    params = [p for p in draft.parameters() if p.requires_grad]
    print(f"trainable params {sum(p.numel() for p in params) / 1e6:.2f}M", flush=True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(args.seed)
    held_batches = make_batches(held, inv, args.max_len, args.batch_tokens, random.Random(0))

    def evaluate() -> dict:
        draft.eval()
        tot = top1 = 0
        loss = 0.0
        hits4 = 0
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            for inp, tid, tpr, msk in held_batches:
                lg = draft(input_ids=inp).logits
                l, a, n = kd_loss(lg, tid, tpr, msk)
                loss += float(l) * n
                tot += n
                top1 += a
                tgt = tid[..., 0]
                top4 = lg.float().topk(4, -1).indices  # [B, T, 4]
                hits4 += int(((top4 == tgt[..., None]).any(-1) & msk & (tgt >= 0)).sum())
        draft.train()
        return {"loss": loss / max(1, tot), "top1": top1 / max(1, tot), "top4": hits4 / max(1, tot)}

    print("held-out at init:", evaluate(), flush=True)
    t0 = time.time()
    budget = args.train_minutes * 60
    step = 0
    epoch = 0
    done = False
    run_loss, run_acc, run_n = 0.0, 0, 0
    while not done:
        batches = make_batches(train, inv, args.max_len, args.batch_tokens, rng)
        for inp, tid, tpr, msk in batches:
            el = time.time() - t0
            if el > budget:
                done = True
                break
            # cosine decay over the time budget (fraction of wall time spent), short warm-up
            frac = el / budget
            lr = args.lr * min(1.0, (step + 1) / args.warmup_steps) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
            for g in opt.param_groups:
                g["lr"] = lr
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                lg = draft(input_ids=inp).logits
            loss, a, n = kd_loss(lg, tid, tpr, msk)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            run_loss += float(loss.detach()) * n
            run_acc += a
            run_n += n
            if step % 25 == 0:
                print(f"step {step} ep {epoch} {el / 60:.1f} min lr {lr:.2e} loss {run_loss / run_n:.3f} "
                      f"top1 {run_acc / run_n:.3f}", flush=True)
                run_loss, run_acc, run_n = 0.0, 0, 0
        epoch += 1
    ev = evaluate()
    print(f"held-out after {step} steps, {epoch} epochs: {ev}", flush=True)
    draft.eval()
    meta = {
        "alias": "embedded-draft", "target": "SmolLM2-135M-Instruct", "tokenizer_fingerprint": tokenizer_fingerprint(tok),
        "source_layers": layers, "train_tokens": n_train, "heldout_tokens": n_held, "steps": step,
        "epochs_started": epoch, "train_minutes": round((time.time() - t0) / 60, 1), "lr": args.lr,
        "heldout": ev, "heldout_vocab_coverage": cover / max(1, n_held),
        "generation": [json.loads(x) for x in (work / "gen_log.jsonl").read_text().splitlines()]
        if (work / "gen_log.jsonl").exists() else [],
        "build": "python -m benchmarks.train_draft --stage train " + " ".join(
            (f"--{k.replace('_', '-')}" if v else f"--no-{k.replace('_', '-')}") if isinstance(v, bool)
            else f"--{k.replace('_', '-')} {v}" for k, v in sorted(vars(args).items()) if k != "stage"),
    }
    path = save_artifact(draft, args.out, meta)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=["gen", "train", "all"], default="all")
    ap.add_argument("--work", default=".cache/draft_build", help="generated data and logs")
    ap.add_argument("--out", default="edge_agent/artifacts/embedded-draft", help="artifact path (no suffix)")
    ap.add_argument("--specbench", default="../shared/data/specbench_prompts.jsonl",
                    help="Spec-Bench prompts JSONL (its non-MT-Bench categories are used); optional")
    ap.add_argument("--gen-minutes", type=float, default=60.0, help="wall-clock budget for data generation")
    ap.add_argument("--gen-batch", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=640)
    ap.add_argument("--temperature", type=float, default=0.8, help="the sampled copy of every prompt")
    ap.add_argument("--top-k", type=int, default=32, help="target log-probs stored per token")
    ap.add_argument("--train-minutes", type=float, default=45.0, help="wall-clock budget for training")
    ap.add_argument("--layers", default="0,10,20,29", help="target layers the draft starts from")
    ap.add_argument("--vocab", type=int, default=16384, help="draft head vocabulary V'")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--heldout-frac", type=float, default=0.04)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast training")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    if args.stage in ("gen", "all"):
        stage_gen(args)
    if args.stage in ("train", "all"):
        stage_train(args)


if __name__ == "__main__":
    main()
