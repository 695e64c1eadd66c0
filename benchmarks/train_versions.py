"""Two target versions of the embedded SmolLM2 target: short LoRA fine-tunes (FlexSpec §III-B).

FlexSpec's platform fact: the cloud target evolves by parameter-efficient fine-tuning while
the edge's draft stays frozen. This script makes two such versions of the embedded target
from data every install of the project already has, as chat instructions (the loss on the
answer only):

- ``code``: "Continue this Python code" -> the next lines, from the Python standard
  library's own sources (``sysconfig`` stdlib; held-out modules never used);
- ``docs``: "Write the README of the Python package X" -> its long description, from the
  ``*.dist-info/METADATA`` of the wheels installed in the venv.

LoRA r=8 on every linear of the last 10 of 30 layers (PEFT format, saved in bf16: ~1.6 MB
each), bf16 autocast, AdamW lr 2e-3, 40 steps of 4 examples of at most 192 tokens (the defaults:
what the committed artifacts were built with, their ``build.json``); ``make adapters``, i.e.
``nice -n 10 python -m benchmarks.train_versions`` (4-7 min per version on 2 loaded cores;
``--steps``, ``--out``). Output: ``deploy/artifacts/versions/{code,docs}/``
(adapter_config.json + adapter_model.safetensors + build.json), loadable by PEFT and by the
verifier (``target.adapters``). ``build.json`` records the settings and the data: the Python
and library versions, the pool of stdlib modules / installed wheels the examples were drawn
from, those drawn, and a hash of the training examples (a rebuild on another install draws
from another pool; the hash tells whether it trained on the same text).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import random
import sysconfig
import time
from importlib import metadata
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parents[1] / "deploy" / "artifacts" / "versions"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LAYERS = list(range(20, 30))  # the last third: the backward stops there (minutes on 2 cores, not hours)
HELD_OUT = ("json", "csv", "textwrap", "heapq", "bisect", "fractions", "statistics", "shlex")  # benchmark prompts


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if not p.name.startswith(("test", "_")))


def code_examples(rng: random.Random, n: int, held_out: bool = False,
                  used: set[str] | None = None) -> list[tuple[str, str]]:
    """(instruction, answer): a window of a stdlib module's source, its first lines given;
    ``used`` collects the modules drawn."""
    files = code_pool(held_out)
    out = []
    while len(out) < n:
        f = rng.choice(files)
        lines = f.read_text(errors="ignore").splitlines()
        if len(lines) < 40:
            continue
        i = rng.randrange(0, len(lines) - 30)
        given, rest = "\n".join(lines[i: i + 10]), "\n".join(lines[i + 10: i + 30])
        if len(given.strip()) < 80 or len(rest.strip()) < 80:
            continue
        out.append((f"Continue this Python code:\n```python\n{given}\n```", rest))
        if used is not None:
            used.add(f.stem)
    return out


def code_pool(held_out: bool = False) -> list[Path]:
    return [p for p in _stdlib_files() if (p.stem in HELD_OUT) == held_out]


def _metadata() -> list[tuple[str, str, str]]:
    """(package, version, long description) of the installed wheels."""
    site = Path(sysconfig.get_paths()["purelib"])
    out = []
    for m in sorted(site.glob("*.dist-info/METADATA")):
        head, _, body = m.read_text(errors="ignore").partition("\n\n")
        name, version = (next((ln.split(":", 1)[1].strip() for ln in head.splitlines() if ln.startswith(k)), None)
                         for k in ("Name:", "Version:"))
        if name and len(body.strip()) > 400:
            out.append((name, version or "?", body.strip()))
    return out


def docs_pool(held_out: bool = False) -> list[tuple[str, str, str]]:
    return [d for i, d in enumerate(_metadata()) if (i % 8 == 0) == held_out]


def docs_examples(rng: random.Random, n: int, held_out: bool = False,
                  used: set[str] | None = None) -> list[tuple[str, str]]:
    """(instruction, answer): a package's README, from a random paragraph on; ``used``
    collects the wheels drawn (``name==version``)."""
    docs = docs_pool(held_out)
    out = []
    while len(out) < n:
        name, version, body = rng.choice(docs)
        paras = [p for p in body.split("\n\n") if p.strip()]
        i = rng.randrange(0, max(1, len(paras) - 3))
        out.append((f"Write the README of the Python package {name}.", "\n\n".join(paras[i: i + 4])[:1500]))
        if used is not None:
            used.add(f"{name}=={version}")
    return out


DATA = {"code": code_examples, "docs": docs_examples}
LIBRARIES = ("torch", "transformers", "peft", "safetensors", "tokenizers")


def data_provenance(version: str, used: set[str], examples: list[tuple[str, str]]) -> dict:
    """What a rebuild needs to know to train on the same data: the interpreter and library
    versions, the pool the examples were drawn from, the sources drawn, the examples' hash."""
    pool = ([p.stem for p in code_pool()] if version == "code"
            else [f"{name}=={v}" for name, v, _ in docs_pool()])
    libs = {}
    for lib in LIBRARIES:
        try:
            libs[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            libs[lib] = None
    return {"python": platform.python_version(), "libraries": libs,
            "pool_kind": "stdlib modules" if version == "code" else "installed wheels (name==version)",
            "pool_sources": pool, "drawn_sources": sorted(used),
            "examples_sha256": hashlib.sha256(json.dumps(examples).encode()).hexdigest()}


def encode(tok, instruction: str, answer: str, max_len: int) -> tuple[list[int], int]:
    """Chat-templated ids and where the answer starts (the loss covers the answer only)."""
    prompt = tok.apply_chat_template([{"role": "user", "content": instruction}], tokenize=False,
                                     add_generation_prompt=True)
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    a_ids = tok(answer + tok.eos_token, add_special_tokens=False)["input_ids"]
    ids = (p_ids + a_ids)[:max_len]
    return ids, min(len(p_ids), len(ids))


def train(version: str, steps: int, batch: int, max_len: int, lr: float, seed: int, out: Path) -> dict:
    from peft import LoraConfig, get_peft_model

    from specdec.model.loading import load_model

    lm = load_model("embedded", dtype="float32", device="cpu")
    tok = lm.tokenizer
    rng = random.Random(seed)
    torch.manual_seed(seed)
    used: set[str] = set()
    examples = DATA[version](rng, steps * batch, used=used)
    data = [encode(tok, q, a, max_len) for q, a in examples]
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, layers_to_transform=LAYERS, lora_dropout=0.0,
                     bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(lm.model, cfg)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.1, 1 - s / steps))
    t0, losses = time.time(), []
    for step in range(steps):
        rows = data[step * batch: (step + 1) * batch]
        L = max(len(ids) for ids, _ in rows)
        x = torch.full((len(rows), L), tok.pad_token_id or 0, dtype=torch.long)
        y = torch.full((len(rows), L), -100, dtype=torch.long)
        mask = torch.zeros((len(rows), L), dtype=torch.long)
        for i, (ids, start) in enumerate(rows):
            x[i, : len(ids)] = torch.tensor(ids)
            y[i, start: len(ids)] = torch.tensor(ids[start:])
            mask[i, : len(ids)] = 1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, attention_mask=mask, labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            print(f"{version} step {step:4d} loss {sum(losses[-10:]) / len(losses[-10:]):.3f} "
                  f"({time.time() - t0:.0f} s)", flush=True)
    dest = out / version
    for p in params:  # the artifact in bf16 (half the bytes; the verifier casts to its dtype)
        p.data = p.data.to(torch.bfloat16)
    model.save_pretrained(str(dest))
    finish_artifact(dest)
    info = {"version": version, "base": "SmolLM2-135M-Instruct (embedded)", "targets": TARGETS, "layers": LAYERS,
            "r": 8,
            "lora_alpha": 16, "steps": steps, "batch": batch, "max_len": max_len, "lr": lr, "seed": seed,
            "train_seconds": round(time.time() - t0, 1), "loss_first10": sum(losses[:10]) / 10,
            "loss_last10": sum(losses[-10:]) / 10,
            "data": ("Python stdlib sources (held out: " + ", ".join(HELD_OUT) + ")") if version == "code"
            else "installed wheels' METADATA long descriptions (every 8th package held out)",
            **data_provenance(version, used, examples)}
    (dest / "build.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def finish_artifact(dest: Path) -> None:
    """No local paths in the artifact (PEFT records the base's directory) and no generated model card."""
    cfg = json.loads((dest / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    (dest / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (dest / "README.md").unlink(missing_ok=True)


def parser() -> argparse.ArgumentParser:
    """The defaults are the committed artifacts' settings (their build.json): ``make adapters``
    rebuilds them as they are."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", nargs="+", default=list(DATA), choices=list(DATA))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=192)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    return ap


def main() -> None:
    a = parser().parse_args()
    torch.set_num_threads(2)
    for v in a.versions:
        print(json.dumps(train(v, a.steps, a.batch, a.max_len, a.lr, a.seed, a.out)))


if __name__ == "__main__":
    main()
