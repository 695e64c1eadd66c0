"""One pipeline stage of a sharded verifier: a Ray actor holding a contiguous slice of the target.

:class:`PipelineStage`: layers ``[first, last)`` and their exit heads; docs/verifier.md, "Pipeline stages"."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from deploy.config import EarlyExitConfig, ModelConfig
from deploy.verifier.kv_sizing import Sizing, check_stage
from specdec import clock
from specdec.exit_heads import ExitHeads, exit_rows
from specdec.model.batch import SeqInput
from specdec.model.checkpoint import CheckpointConfig, prune, read_weights, tiny_config
from specdec.model.decoder import DecoderModel
from specdec.model.loading import (TINY_PREFIX, LoadedModel, load_target, load_tokenizer, loaded_model, resolve_device,
                                   resolve_dtype, safetensors_dir)
from specdec.model.runner import Keep, ModelRunner


# -- loading one stage ----------------------------------------------------------------
class ModelShell:
    """What the engine needs of a target it does not hold: its config (vocab, context)."""

    def __init__(self, config, generation_config=None):
        self.config = config
        self.generation_config = generation_config


def target_config(model_cfg: ModelConfig):
    """The target's config without loading weights (the split needs only this)."""
    if model_cfg.model.startswith(TINY_PREFIX):
        if model_cfg.tokenizer is not None and "vocab_size" not in (model_cfg.tiny_config or {}):
            return load_target(model_cfg, weights_only=True, dtype="float32", device="cpu").model.config
        return CheckpointConfig.from_dict(tiny_config(**(model_cfg.tiny_config or {})))
    path = safetensors_dir(model_cfg.model)
    if path is not None:
        return CheckpointConfig.read(path)
    from transformers import AutoConfig

    path = Path(model_cfg.model)
    if path.suffix == ".gguf":
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoConfig.from_pretrained(str(path))


def load_stage(model_cfg: ModelConfig, first: int, last: int, with_tokenizer: bool = False,
               keep_head: bool = False, shard: tuple[int, int] | None = None) -> LoadedModel:
    """The target with only layers ``[first, last)`` (+ embedding / head) materialised;
    ``keep_head``: the final norm and LM head too, whatever the slice; ``shard`` ``(rank, tp)``: of a safetensors
    checkpoint only that tensor-parallel rank's part is read (others are read whole, the rank keeps its part)."""
    path = safetensors_dir(model_cfg.model)
    if path is None:  # tiny-random, GGUF, hub id: load whole, keep the slice
        loaded = load_target(model_cfg, weights_only=True)
        prune(loaded.model, first, last, keep_head)
        return loaded
    device = resolve_device(model_cfg.device)
    dtype = resolve_dtype(model_cfg.dtype, device, model_cfg.model)
    model = read_weights(path, dtype, device, first, last, keep_head, shard)
    tok = load_tokenizer(str(path), model_cfg.tokenizer) if with_tokenizer else None
    return loaded_model(model, tok, model_cfg.model, model_cfg.seed, device, dtype)


# -- the stage actor ----------------------------------------------------------------
def exit_layers(cfg: EarlyExitConfig) -> tuple[int, ...]:
    """The exits ``cfg`` runs: its layers, or all of its artifact's."""
    if cfg.layers is not None:
        return tuple(sorted(cfg.layers))
    return tuple(ExitHeads.artifact_layers(cfg.heads))


@dataclass(frozen=True)
class StageExits:
    """The exit layers the stages hold and the vocabulary subset their logits are over (to walk trees)."""

    layers: tuple[int, ...]
    ids: torch.Tensor  # [K] long


class PipelineStage:
    """One pipeline stage (a Ray actor): a ModelRunner over its slice, its busy time, its exit heads."""

    def __init__(self, model_cfg: ModelConfig, first: int, last: int, torch_threads: int | None = None,
                 kv_capacity_tokens: int = 1 << 16, compile: bool = False,
                 early_exit: EarlyExitConfig | None = None, prefix_caching: bool = False,
                 sizing: Sizing | None = None, tp_runner=None):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        if tp_runner is not None:  # this actor is rank 0 of the stage's tensor-parallel group: tp_runner() builds it
            self.heads = None
            self.runner = tp_runner()
            info = self.runner.loaded
            self.info = LoadedModel(ModelShell(info.model.config, info.model.generation_config), info.tokenizer,
                                    info.name, info.eos_token_ids, str(info.device), info.dtype)
            self.reset_stats()
            return
        here = ()
        if early_exit is not None and early_exit.enabled:
            here = tuple(x for x in exit_layers(early_exit) if first < x <= last)
        loaded = load_stage(model_cfg, first, last, with_tokenizer=first == 0, keep_head=bool(here))
        self.heads: ExitHeads | None = None
        if here:
            from deploy.verifier.early_stream import load_heads

            self.heads = load_heads(early_exit, loaded.model, here)  # copies the head's subset rows
            prune(loaded.model, first, last)  # then the rest of the head goes (unless this is the last stage)
        model = DecoderModel(loaded.model, first, last, compile)
        if sizing is not None:  # the same pool in every stage: refused here if this device cannot hold it
            self.kv_plan = check_stage(model, loaded.model, sizing, kv_capacity_tokens, loaded.name)
        self.runner = ModelRunner(model, kv_capacity_tokens=kv_capacity_tokens, compile=compile,
                                  prefix_caching=prefix_caching)
        m = loaded.model
        self.info = LoadedModel(ModelShell(m.config, getattr(m, "generation_config", None)), loaded.tokenizer,
                                loaded.name, loaded.eos_token_ids, str(loaded.device), loaded.dtype)
        del loaded, m  # only the slice stays referenced (through the runner)
        self.reset_stats()

    def describe(self) -> LoadedModel:
        """The target's metadata with a config-only model (what the replica's engine needs)."""
        return self.info

    def exit_info(self) -> tuple[tuple[int, ...], torch.Tensor | None]:
        """The exit layers this stage holds and their vocabulary subset ids [K]."""
        return (self.heads.layers, self.heads.ids) if self.heads is not None else ((), None)

    def forward_early(self, batch_id: int, items: list[SeqInput], hidden: torch.Tensor | None,
                      picks: list[tuple[int, str]]):
        """Like :meth:`forward`, plus the exits' subset logits [R, K] of ``picks``' rows as a second return value."""
        early = {"rows": {}, "seconds": 0.0, "cpu_seconds": 0.0}

        def on_layer(n: int, h: torch.Tensor, batch) -> None:
            if n in self.heads.layers:
                t0, c0 = clock.perf_counter(), clock.thread_time()
                sub = exit_rows(self.heads, n, h, batch, picks)
                if sub is not None:
                    early["rows"][n] = sub
                early["seconds"] += clock.perf_counter() - t0
                early["cpu_seconds"] += clock.thread_time() - c0

        return self.forward(batch_id, items, hidden, on_layer), early

    def forward(self, batch_id: int, items: list[SeqInput], hidden: torch.Tensor | None = None, on_layer=None):
        t0, c0 = clock.perf_counter(), time.process_time()
        out = self.runner.forward(batch_id, items, hidden, on_layer)
        # results leave through the object store: host memory, whatever the device
        out = out.cpu() if isinstance(out, torch.Tensor) else [x.cpu() for x in out]
        t1 = clock.perf_counter()
        self._busy += t1 - t0
        self._cpu += time.process_time() - c0
        self._forwards += 1
        self._intervals.append((t0, t1))
        return out

    def commit(self, batch_id: int, keep: dict[str, Keep]) -> None:
        t0, c0 = clock.perf_counter(), time.process_time()
        self.runner.commit(batch_id, keep)
        self._busy += clock.perf_counter() - t0
        self._cpu += time.process_time() - c0

    def abort(self, batch_id: int) -> None:
        self.runner.abort(batch_id)

    def drop(self, sid: str) -> None:
        self.runner.drop(sid)

    def truncate(self, sid: str, length: int) -> None:
        self.runner.truncate(sid, length)

    def share_prefix(self, sid: str, tokens: list[int], salt=None) -> int:
        return self.runner.share_prefix(sid, tokens, salt)

    def cache_prefix(self, sid: str, tokens: list[int], salt=None) -> None:
        self.runner.cache_prefix(sid, tokens, salt)

    def kv_tokens(self) -> int:
        return self.runner.kv_tokens()

    def session_kv(self, sid: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This stage's KV of a session: keys, values [L_stage, H, length, d] (for checks)."""
        return self.runner.session_kv(sid)

    def stats(self) -> dict:
        """busy_s: wall seconds inside forward/commit; cpu_s: this process's CPU seconds then; wall_s: since reset."""
        return {"first": self.runner.first, "last": self.runner.last, "busy_s": self._busy, "cpu_s": self._cpu,
                "wall_s": clock.perf_counter() - self._t0, "forwards": self._forwards,
                "kv_tokens": self.runner.kv_tokens(), "device": str(self.runner.device),
                "torch_threads": torch.get_num_threads(),
                "placement_group_id": ray.get_runtime_context().get_placement_group_id(),
                "resources": ray.get_runtime_context().get_assigned_resources()}

    def busy_intervals(self) -> list[tuple[float, float]]:
        """(start, end) of the recent forwards, ``time.perf_counter`` (comparable across one machine's stages)."""
        return list(self._intervals)

    def reset_stats(self) -> None:
        self._busy, self._cpu, self._forwards, self._t0 = 0.0, 0.0, 0, clock.perf_counter()
        self._intervals: deque[tuple[float, float]] = deque(maxlen=100_000)
