"""Exit heads: the target's next-token guess at an intermediate layer (early-exit paper §3, Fig. 3).
h [N, D] after ``layer`` layers -> z = h + U·W·rmsnorm(h; g) -> logits [N, K] = H[ids]·rmsnorm(z; final_norm), H the
target's LM head; :class:`EarlyExit` walks trees with them mid-forward, output untouched. docs/specdec.md."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec import clock
from specdec.acceptance import walk_tree
from specdec.model.glue import rms_norm
from specdec.sampling import SamplingParams, target_probs
from specdec.tree import DraftTree

ARTIFACT_DIR = Path(__file__).resolve().parent / "artifacts"
ALIASES = {"embedded": ARTIFACT_DIR / "embedded-exit-heads.safetensors"}


class ExitAdapter(torch.nn.Module):
    """One exit's trainable part: g [D], W [r, D], U [D, r] (U = 0: the logit lens)."""

    def __init__(self, hidden: int, rank: int, norm_init: torch.Tensor | None = None):
        super().__init__()
        self.g = torch.nn.Parameter(norm_init.detach().float().clone() if norm_init is not None
                                    else torch.ones(hidden))
        self.down = torch.nn.Parameter(torch.randn(rank, hidden) / math.sqrt(hidden))
        self.up = torch.nn.Parameter(torch.zeros(hidden, rank))

    def forward(self, h: torch.Tensor, eps: float) -> torch.Tensor:
        """h [N, D] -> z [N, D] (same dtype)."""
        a = rms_norm(h, self.g.to(h.dtype), eps)
        return h + (a @ self.down.to(h.dtype).t()) @ self.up.to(h.dtype).t()


@dataclass
class ExitHeads:
    """Trained adapters for some layers + the vocabulary subset, bound to one target."""

    layers: tuple[int, ...]  # exits after this many decoder layers, increasing
    adapters: dict[int, ExitAdapter]
    ids: torch.Tensor  # [K] long: target token ids the exits predict over
    final_norm: torch.Tensor  # [D]
    head: torch.Tensor  # [K, D]: the target's LM head rows for ``ids``
    eps: float
    meta: dict

    @classmethod
    def init(cls, hf_model, layers, rank: int = 64, ids: torch.Tensor | None = None, seed: int = 0) -> "ExitHeads":
        """Untrained heads (logit lens + a zero adapter) for ``hf_model``; ``ids``: all of the vocabulary."""
        torch.manual_seed(seed)
        cfg = hf_model.config
        layers = tuple(sorted(int(x) for x in layers))
        if not layers or not all(1 <= x < cfg.num_hidden_layers for x in layers):
            raise ValueError(f"exit layers must be in 1..{cfg.num_hidden_layers - 1}, got {layers}")
        norm = hf_model.model.norm.weight.detach()
        adapters = {x: ExitAdapter(cfg.hidden_size, rank, norm) for x in layers}
        ids = torch.arange(cfg.vocab_size) if ids is None else ids.long()
        return cls._bind(hf_model, layers, adapters, ids, {"rank": rank, "trained": False})

    @classmethod
    def _bind(cls, hf_model, layers, adapters, ids, meta) -> "ExitHeads":
        cfg = hf_model.config
        w = hf_model.lm_head.weight.detach()  # [V, D]
        dtype = w.dtype
        for a in adapters.values():
            a.to(dtype=torch.float32)
        return cls(tuple(layers), adapters, ids, hf_model.model.norm.weight.detach(),
                   w.index_select(0, ids.to(w.device)).contiguous(), float(cfg.rms_norm_eps),
                   dict(meta, hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
                        vocab_size=cfg.vocab_size, dtype=str(dtype)))

    @staticmethod
    def _artifact(path: str | Path) -> tuple[Path, dict]:
        p = Path(ALIASES.get(str(path), path)).with_suffix(".safetensors")
        if not p.exists():
            raise FileNotFoundError(f"exit heads {p} not found (build them: make exit-heads)")
        return p, json.loads(p.with_suffix(".json").read_text())

    @classmethod
    def artifact_layers(cls, path: str | Path) -> list[int]:
        """The exit layers an artifact (or alias) holds, without loading it."""
        return [int(x) for x in cls._artifact(path)[1]["layers"]]

    @classmethod
    def load(cls, path: str | Path, hf_model, layers=None) -> "ExitHeads":
        """Load an artifact (or an alias: ``embedded``) for ``hf_model``; ``layers``: a subset of its exits."""
        from safetensors.torch import load_file

        p, meta = cls._artifact(path)
        cfg = hf_model.config
        if meta["hidden_size"] != cfg.hidden_size or meta["num_layers"] != cfg.num_hidden_layers:
            raise ValueError(f"exit heads {p.name} were trained for another model ({meta['hidden_size']} hidden, "
                             f"{meta['num_layers']} layers; the target has {cfg.hidden_size}, {cfg.num_hidden_layers})")
        t = load_file(str(p))
        have = tuple(meta["layers"])
        layers = have if layers is None else tuple(sorted(int(x) for x in layers))
        missing = [x for x in layers if x not in have]
        if missing:
            raise ValueError(f"exit heads {p.name} have layers {list(have)}, not {missing}")
        adapters = {}
        for x in layers:
            a = ExitAdapter(cfg.hidden_size, meta["rank"])
            a.load_state_dict({k: t[f"exit{x}.{k}"].float() for k in ("g", "down", "up")})
            adapters[x] = a
        return cls._bind(hf_model, layers, adapters, t["ids"].long(), meta)

    def save(self, path: str | Path, meta: dict | None = None) -> Path:
        from safetensors.torch import save_file

        p = Path(path).with_suffix(".safetensors")
        p.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"ids": self.ids.to(torch.int32).contiguous()}
        for x, a in self.adapters.items():
            for k, v in a.state_dict().items():
                tensors[f"exit{x}.{k}"] = v.detach().to(torch.bfloat16).contiguous()
        save_file(tensors, str(p))
        self.meta = dict(self.meta, **(meta or {}), layers=list(self.layers))
        p.with_suffix(".json").write_text(json.dumps(self.meta, indent=2) + "\n")
        return p

    @torch.no_grad()
    def logits(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """h [N, D] (the residual stream after ``layer`` layers) -> subset logits [N, K], float32."""
        z = self.adapters[layer](h, self.eps)
        x = rms_norm(z, self.final_norm.to(z.dtype), self.eps)
        return (x.float() @ self.head.float().t()) if x.dtype != torch.bfloat16 else (x @ self.head.t()).float()


class SubsetRows:
    """Exit logits over the subset, read row by row as full-vocabulary rows (-inf elsewhere)."""

    def __init__(self, sub: torch.Tensor, ids: torch.Tensor, vocab: int):
        self.sub, self.ids, self.vocab = sub, ids, vocab  # [R, K], [K]

    def __getitem__(self, i: int) -> torch.Tensor:
        row = torch.full((self.vocab,), float("-inf"))
        row[self.ids] = self.sub[i]
        return row


@dataclass(frozen=True)
class EarlyResult:
    """An exit's guess of a round: accepted path (node indices), next token, its probability (paper Eq. 4)."""

    sid: str
    layer: int
    accepted: tuple[int, ...]
    token: int
    confidence: float
    prefix_len: int  # the prefix the round's tree assumed (identifies the round)


def early_walk(tree: DraftTree, rows: SubsetRows, params: SamplingParams, generator: torch.Generator | None,
               max_emit: int | None, stop_ids: frozenset[int]) -> tuple[tuple[int, ...], int, float]:
    """Walk ``tree`` by the final walk's rule on an exit's logits -> (accepted nodes, next token, path probability)."""
    g = None
    if generator is not None:
        g = torch.Generator()
        g.set_state(generator.get_state())  # the same uniforms, the session's generator untouched
    acc = walk_tree(tree, rows, params, g, max_emit=max_emit, stop_ids=stop_ids)
    conf = 1.0
    walked = [0] + [a + 1 for a in acc.accepted]
    tokens = [tree.tokens[a] for a in acc.accepted] + [acc.bonus]
    for r, t in zip(walked, tokens):
        p = torch.softmax(rows.sub[r].float(), -1) if params.greedy else target_probs(rows[r], params)[rows.ids]
        hit = (rows.ids == t).nonzero()
        conf *= float(p[hit[0, 0]]) if len(hit) else 0.0
    return acc.accepted, acc.bonus, conf


@dataclass(frozen=True)
class WalkJob:
    """One tree to walk early, as the engine will walk it at the last layer."""

    sid: str
    tree: DraftTree
    params: SamplingParams
    generator: torch.Generator | None
    max_emit: int | None
    stop_ids: frozenset[int]
    prefix_len: int
    path: tuple[int, ...] | None  # verified node -> node of the tree the edge sent (a clipped tree), or None


def exit_rows(heads: ExitHeads, layer: int, h: torch.Tensor, batch, picks) -> torch.Tensor | None:
    """The exit's subset logits [R, K] (CPU) of the items ``picks`` names, in order; None for a stale batch."""
    counts = [len(it.logit_rows) for it in batch.items]
    if any(i >= len(counts) or batch.items[i].sid != sid for i, sid in picks):
        return None
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    flat = batch.logit_index.to(h.device)
    pick = torch.cat([torch.arange(starts[i], starts[i] + counts[i]) for i, _ in picks])
    return heads.logits(layer, h[flat[pick.to(flat.device)]]).cpu()


class EarlyExit:
    """The per-layer hook of one verify forward: after each exit layer, the asking trees' early results, to ``sink``."""

    def __init__(self, heads: ExitHeads, vocab: int, jobs: list[tuple[int, WalkJob]], sink):
        self.heads, self.vocab, self.jobs, self.sink = heads, vocab, jobs, sink  # jobs: (item index, job)
        self.layers = frozenset(heads.layers)
        self.picks = [(i, job.sid) for i, job in jobs]  # the batch items (index, session) walked early
        # the cost of early results, measured: exit head, walks, and encoding/queueing the frames (the
        # sink); ``seconds`` is wall time, ``cpu_seconds`` this thread's CPU time (robust to other load)
        self.seconds = 0.0
        self.cpu_seconds = 0.0

    @classmethod
    def for_batch(cls, engine, requests, todo, sink) -> "EarlyExit | None":
        """The hook for one :meth:`VerifierEngine.verify` batch (``todo``: its TreeJobs in item order), or None."""
        jobs = []
        for j, t in enumerate(todo):
            s, tree, kept = t.session, t.tree, t.kept
            if not getattr(requests[t.index], "early", False) or t.proposals is not None:
                continue
            jobs.append((j, WalkJob(s.sid, tree, s.params, s.generator, engine.table.remaining(s), s.stop_ids,
                                    len(s.prefix), tuple(kept) if kept is not None else None)))
        if not jobs:
            return None
        hook = cls(engine.exit_heads, engine.vocab_size, jobs, sink)
        engine.last_early = hook  # its measured seconds, for stats
        return hook

    def __call__(self, layer: int, h: torch.Tensor, batch) -> None:
        if layer not in self.layers or not self.jobs:
            return
        t0, c0 = clock.perf_counter(), clock.thread_time()
        sub = exit_rows(self.heads, layer, h, batch, self.picks)
        self.seconds += clock.perf_counter() - t0
        self.cpu_seconds += clock.thread_time() - c0
        if sub is not None:
            self.walk(layer, sub)

    def walk(self, layer: int, sub: torch.Tensor) -> None:
        """Walk every job's tree with the exit's subset logits ``sub`` [R, K] (jobs' rows in order); to the sink."""
        t0, c0 = clock.perf_counter(), clock.thread_time()
        out, off = [], 0
        for _, job in self.jobs:
            n = len(job.tree) + 1  # the root row and one per node
            rows = SubsetRows(sub[off: off + n], self.heads.ids, self.vocab)
            off += n
            acc, tok, conf = early_walk(job.tree, rows, job.params, job.generator, job.max_emit, job.stop_ids)
            if job.path is not None:
                acc = tuple(job.path[a] for a in acc)
            out.append(EarlyResult(job.sid, layer, acc, tok, conf, job.prefix_len))
        self.sink(out)
        self.seconds += clock.perf_counter() - t0
        self.cpu_seconds += clock.thread_time() - c0
