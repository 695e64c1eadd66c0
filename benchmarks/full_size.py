"""A real-size target through the real loading path, and edge agents against it in this process.

``python -m benchmarks.full_size --shape llama3-8b --device cuda`` writes a random-weight checkpoint
of that shape (``benchmarks/model_shapes.json``: config.json, safetensors shards, the embedded
tokenizer's files) to a directory, loads it as a verifier replica loads ``target.model: DIR``
(:func:`deploy.verifier.startup.start_target`: KV pool sized from ``gpu_memory_utilization``), and
runs edge agents (random-weight drafts of the shape's draft model, on the same device) against that
engine at 1, 8 and 32 sessions, their verify rounds batched into one forward as a replica batches
them. Each level also runs one-token decoding (tree budget 0) through the same engine, and every
session's greedy output must equal it. Prints load time, pool capacity and tokens/s per session.

Random weights accept almost no draft tokens: the figures measure the load, the pool and the
round costs at that shape, not speculative speed-ups. Imports neither Ray nor FastAPI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import shutil
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import torch

from benchmarks.model_shapes import CATALOGUE

SHAPES = CATALOGUE  # name -> hub_id, draft, config (benchmarks/model_shapes.json)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mistral": "MistralForCausalLM"}
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "COMPLETE")


def shape_names() -> list[str]:
    return [k for k in SHAPES if not k.startswith("_")]


def tokenizer_files(where: Path | None = None) -> list[Path]:
    """The tokenizer files in ``where`` (default: the embedded SmolLM2's, converted if need be):
    tokenizer.json, its config, the chat template; a GPU box without the embedded weights needs
    only these."""
    from specdec.model.loading import EMBEDDED_NAME, cache_dir, ensure_embedded_model

    if where is None:
        where = cache_dir() / "models" / EMBEDDED_NAME
        where = where if (where / "tokenizer.json").exists() else ensure_embedded_model()
    return [p for p in sorted(Path(where).iterdir())
            if p.is_file() and p.name not in MODEL_FILES and p.suffix != ".safetensors"]


@torch.no_grad()
def write_checkpoint(config: dict, out: Path, device: str = "cpu", seed: int = 0, std: float = 0.02,
                     shard_bytes: int = 4 << 30, tokenizer: Path | None = None) -> Path:
    """A safetensors checkpoint of ``config`` (a config.json dict) with random weights drawn on
    ``device`` in the config's ``torch_dtype`` (N(0, std) matrices, unit norms, zero biases), in
    shards of at most ``shard_bytes`` with their index, plus the tokenizer's files (:func:`tokenizer_files`). Reused
    when ``out`` holds a complete one of the same config."""
    from safetensors.torch import save_file

    from specdec.model.checkpoint import CausalLMWeights, CheckpointConfig

    out = Path(out)
    config = {"architectures": [ARCHITECTURES[config["model_type"]]], **config}
    done = out / "COMPLETE"
    if done.exists() and json.loads((out / "config.json").read_text()) == config:
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    dtype = getattr(torch, config.get("torch_dtype", "bfloat16"))
    with torch.device("meta"):
        names = [(n, tuple(p.shape)) for n, p in CausalLMWeights(CheckpointConfig.from_dict(config)).named_parameters()]
    if config.get("tie_word_embeddings"):
        names = [(n, s) for n, s in names if n != "lm_head.weight"]
    g = torch.Generator(device).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, shape in names:
        t = torch.empty(shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        else:
            t.normal_(0.0, std, generator=g)
        n = t.numel() * t.element_size()
        if size + n > shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.cpu() for k, v in shard.items()}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        total += sum(v.numel() * v.element_size() for v in shard.values())
        shard.clear()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": config.get("bos_token_id"),
                                                            "eos_token_id": config.get("eos_token_id")}))
    del shards, t
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the replica's start measures what the device holds
    for f in tokenizer_files(tokenizer):
        shutil.copy(f, out / f.name)
    done.write_text("")
    return out


class BatchingEngine:
    """An engine behind one worker thread that runs concurrent verify calls as one forward: it waits
    until every open session has a round queued or ``window_s`` has passed, as a replica's batch
    loop does (without Serve). Other calls (open, close) run one at a time on the same thread."""

    def __init__(self, engine, window_s: float):
        self.engine, self.window_s = engine, window_s
        self.live: set[str] = set()
        self.batches: list[int] = []  # sessions per verify forward
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="batching-engine")
        self._thread.start()

    def __getattr__(self, name):  # vocab_size, limits, eos_token_ids, exit_heads: the engine's
        return getattr(self.engine, name)

    def open(self, reqs):
        return self._submit("open", reqs)

    def close(self, sid):
        return self._submit("close", sid)

    def verify(self, reqs, on_early=None):
        return self._submit("verify", reqs)

    def stop(self) -> None:
        self._q.put(("stop", None, None))
        self._thread.join()

    def _submit(self, kind: str, arg):
        fut: Future = Future()
        self._q.put((kind, arg, fut))
        return fut.result()

    def _run_one(self, kind: str, arg, fut: Future) -> None:
        try:
            out = getattr(self.engine, kind)(arg)
        except BaseException as e:
            fut.set_exception(e)
            return
        if kind == "open":
            self.live.update(r.sid for r, res in zip(arg, out) if not getattr(res, "finished", True))
        elif kind == "close":
            self.live.discard(arg)
        fut.set_result(out)

    def _loop(self) -> None:
        while True:
            kind, arg, fut = self._q.get()
            if kind == "stop":
                return
            if kind != "verify":
                self._run_one(kind, arg, fut)
                continue
            batch = [(arg, fut)]
            deadline = time.monotonic() + self.window_s
            while len(batch) < len(self.live):
                try:
                    kind, arg, fut = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if kind == "stop":
                    self._q.put((kind, arg, fut))
                    break
                if kind == "verify":
                    batch.append((arg, fut))
                else:
                    self._run_one(kind, arg, fut)
            self._verify(batch)

    def _verify(self, batch) -> None:
        reqs = [r for arg, _ in batch for r in arg]
        try:
            results = self.engine.verify(reqs)
        except BaseException as e:
            for _, fut in batch:
                fut.set_exception(e)
            return
        self.batches.append(len(reqs))
        i = 0
        for arg, fut in batch:
            fut.set_result(results[i:i + len(arg)])
            i += len(arg)


async def run_sessions(engine: BatchingEngine, drafts, prompts: list[list[int]], max_tokens: int, budget: int,
                       depth: int, name: str) -> list:
    """One generation per prompt, concurrently, each by its own edge agent (``drafts[i]``); tree
    budget 0: one-token decoding through the same path."""
    from specdec.sampling import SamplingParams
    from edge_agent.agent import AgentConfig, EdgeAgent
    from edge_agent.transport import LocalTransport

    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=len(prompts) + 8))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    async def one(prompt, drafter):
        transport = LocalTransport(engine, model_name=name, budget_hint=budget, default_depth=depth)
        transport._lock = nullcontext()  # the batching engine serialises; the lock would keep batches at one
        agent = EdgeAgent(transport, drafter, config=AgentConfig(mode="stop-and-wait", depth_policy="fixed",
                                                                 depth=depth, budget=max(budget, 1)))
        t0 = time.perf_counter()
        try:
            res = await agent.generate(prompt, params)
        finally:
            agent.close()
        return res, time.perf_counter() - t0

    return await asyncio.gather(*(one(p, d) for p, d in zip(prompts, drafts)))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.full_size", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="small", choices=shape_names())
    ap.add_argument("--out", type=Path, help="checkpoint directory (default .cache/full_size/SHAPE; reused)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--tokenizer", type=Path, help="directory with the tokenizer files (default: the embedded model's)")
    ap.add_argument("--sessions", default="1,8,32", help="concurrency levels")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--budget", type=int, default=8, help="draft tree nodes a round")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--draft", default="paired", choices=["paired", "self"],
                    help="paired: the shape's draft model (random: accepts ~nothing); self: the target's own "
                         "weights (accepts nearly every node: the equality check then covers accepted paths)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.7,
                    help="the target's share of the device (the drafts share it)")
    ap.add_argument("--window-ms", type=float, default=10.0, help="how long a batch waits for the other sessions")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args(argv)

    from deploy.config import AppConfig
    from specdec.model.loading import cache_dir, load_weights, resolve_device
    from deploy.verifier.startup import start_target

    device = resolve_device(a.device)
    spec = SHAPES[a.shape]
    out = a.out or cache_dir() / "full_size" / a.shape
    t0 = time.perf_counter()
    target_dir = write_checkpoint(spec["config"], out, device, tokenizer=a.tokenizer)
    draft_shape = spec["draft"] if a.draft == "paired" and spec["draft"] else a.shape
    draft_dir = target_dir if draft_shape == a.shape else write_checkpoint(
        SHAPES[draft_shape]["config"], out.parent / f"{out.name}-draft-{draft_shape}", device, seed=1,
        tokenizer=a.tokenizer)
    print(f"checkpoints {target_dir} and {draft_dir} ({time.perf_counter() - t0:.1f} s)")

    max_len = min(a.max_model_len, spec["config"]["max_position_embeddings"])
    cfg = AppConfig(target={"model": str(target_dir), "device": device, "max_model_len": max_len},
                    verifier={"kv_budget_tokens": None, "gpu_memory_utilization": a.gpu_memory_utilization,
                              "num_gpus_per_stage": 1 if device == "cuda" else 0})
    _sync(device)
    t0 = time.perf_counter()
    started = start_target(cfg)  # what a replica runs for target.model: DIR
    _sync(device)
    load_s = time.perf_counter() - t0
    print(f"target {a.shape} ({started.loaded.dtype}, {device}) loaded in {load_s:.1f} s; {started.kv_plan.describe()}")
    draft_model = started.loaded.model if draft_dir == target_dir else load_weights(str(draft_dir), device=device).model
    result = {"shape": a.shape, "draft": draft_shape, "device": device, "dtype": str(started.loaded.dtype),
              "load_s": load_s, "kv": started.kv_plan.stats()}
    engine = BatchingEngine(started.engine, a.window_ms / 1e3)
    try:
        result["levels"] = sweep(engine, draft_model, a, started.loaded.name)
    finally:
        engine.stop()
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    if not all(r["greedy_equal"] for r in result["levels"]):
        raise SystemExit("greedy outputs differ from one-token decoding by the same engine")
    return result


def sweep(engine: BatchingEngine, draft_model, a: argparse.Namespace, name: str) -> list[dict]:
    """Per concurrency level of ``a.sessions``: one-token decoding (tree budget 0) and edge trees of
    ``a.budget`` nodes, session i on the same random prompt i in both; their outputs must be equal."""
    from edge_agent.draft_backends import ModelDrafter

    levels = [int(x) for x in a.sessions.split(",")]
    g = torch.Generator().manual_seed(0)
    vocab = min(engine.vocab_size, draft_model.config.vocab_size)
    prompts = [torch.randint(0, vocab, (a.prompt_len,), generator=g).tolist() for _ in range(max(levels))]
    drafters = [ModelDrafter(draft_model, max_context=a.prompt_len + a.max_tokens + 64) for _ in range(max(levels))]
    rows = []
    for n in levels:
        row: dict = {"sessions": n}
        tokens = {}
        for kind, budget in (("ar", 0), ("sd", a.budget)):
            # untimed first: CUDA graphs of this level's row counts are captured on first use (and both
            # timed runs then find the prompts in the prefix cache alike)
            asyncio.run(run_sessions(engine, drafters[:n], prompts[:n], 4, budget, a.depth, name))
            engine.batches.clear()
            t0 = time.perf_counter()
            runs = asyncio.run(run_sessions(engine, drafters[:n], prompts[:n], a.max_tokens, budget, a.depth, name))
            wall = time.perf_counter() - t0
            tokens[kind] = [r.token_ids for r, _ in runs]
            row[kind] = {"tokens_per_s_per_session": sum(len(r.token_ids) / s for r, s in runs) / n,
                         "tokens_per_s": sum(len(r.token_ids) for r, _ in runs) / wall,
                         "mean_batch": sum(engine.batches) / max(1, len(engine.batches)),
                         "accepted_per_round": sum(r.stats.accepted_tokens for r, _ in runs)
                         / max(1, sum(r.stats.rounds for r, _ in runs))}
        row["greedy_equal"] = tokens["sd"] == tokens["ar"]
        rows.append(row)
        ar, sd = row["ar"], row["sd"]
        print(f"{n:3d} sessions: one-token decoding {ar['tokens_per_s_per_session']:.1f} tok/s/session "
              f"(batch {ar['mean_batch']:.1f}); edge trees of {a.budget} {sd['tokens_per_s_per_session']:.1f} "
              f"tok/s/session (batch {sd['mean_batch']:.1f}, {sd['accepted_per_round']:.2f} accepted a round); "
              f"greedy equal: {row['greedy_equal']}")
    return rows


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
