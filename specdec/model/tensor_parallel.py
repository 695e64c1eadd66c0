"""Tensor parallelism inside a verifier replica (issue 64): a Llama-family decoder sharded Megatron-style over N
ranks, with reductions whose summation order never depends on the batch. docs/tensor_parallel.md.

- :class:`FixedOrderGroup`: the collectives. ``sum`` is an all-gather of every rank's partial sums (a copy: bit
  exact) and an elementwise sum in rank order on every rank, so a row's bits depend on its own partial sums only,
  never on how many rows the buffer holds (a ring all-reduce's order depends on the buffer's chunking).
- :class:`TPDecoderModel`: column-parallel QKV (each rank its own Q heads and their KV heads; KV heads fewer than
  ranks replicated, as vLLM does) and gate/up; row-parallel o_proj and down_proj (one ``sum`` each);
  vocabulary-parallel embedding (one ``sum``) and LM head (logits gathered to rank 0, where the walk runs).
  Each rank's KV pool holds its own KV heads. LoRA target versions are cut as the base weights they add to: B's
  rows of column-parallel linears, A's columns of row-parallel ones (their partial deltas join the one ``sum``).
- What must divide, which heads a rank holds, reading one rank's part of a checkpoint: shard_plan.py."""

from __future__ import annotations

import copy
import datetime
import pickle
import struct
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from specdec.model.decoder import DecoderModel, DecoderSpec
from specdec.model.lora import add_lora
from specdec.model.shard_plan import check_shardable, kv_heads_of, q_heads_of, shard_slicer

COMMAND_BYTES = 1 << 16  # the fixed broadcast of a round's command: a batch's items fit it (else a second one)


class GroupLost(RuntimeError):
    """A collective of the tensor-parallel group failed: a rank died, hung past the timeout or closed the group."""


# -- the group ------------------------------------------------------------------------------
class FixedOrderGroup:
    """One tensor-parallel group's collectives. Rank 0 hosts the rendezvous store. The commands go over gloo (host
    memory); the tensors over ``dev_pg``: the same gloo group on the CPU, NCCL on CUDA (all-gather and gather only:
    copies, bit exact whatever NCCL's algorithm; not run here, no multi-GPU machine: docs/tensor_parallel.md)."""

    def __init__(self, store, pg, rank: int, world: int, dev_pg=None):
        self.store, self.pg, self.rank, self.world = store, pg, rank, world
        self.dev_pg = dev_pg if dev_pg is not None else pg
        self._cmd = torch.empty(COMMAND_BYTES, dtype=torch.uint8)
        self.closed = False

    @classmethod
    def connect(cls, addr: str, port: int, rank: int, world: int, timeout_s: float = 120.0,
                device: str = "cpu") -> "FixedOrderGroup":
        """Join group ``addr:port`` as ``rank`` of ``world`` (rank 0 hosts the store); blocks until all joined."""
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(addr, port, world, rank == 0, timeout=timeout)
        pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world, timeout)
        dev_pg = None
        if torch.device(device).type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            dev_pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world, opts)
        return cls(store, pg, rank, world, dev_pg)

    @classmethod
    def single(cls) -> "FixedOrderGroup":
        """A group of one rank (the sharded code path at tp = 1: no collective runs)."""
        return cls(None, None, 0, 1)

    def _wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as e:  # gloo: a peer's connection reset, or the timeout
            self.closed = True
            raise GroupLost(str(e).splitlines()[0][:300]) from None

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` [.., D] summed, on every rank, in rank order (float32 accumulation; ``x``'s dtype).
        Each output element is ``((x_0 + x_1) + x_2) + ...`` of that element alone: no batch-dependent order."""
        if self.world == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self._wait(self.dev_pg.allgather([parts], [x]))
        acc = parts[0].float() if x.dtype != torch.float32 else parts[0]
        for p in parts[1:]:
            acc.add_(p)  # (an fp32 accumulator: p upcast elementwise, exactly)
        return acc.to(x.dtype) if x.dtype != torch.float32 else acc

    def gather_cols(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's ``x`` [R, C] side by side in rank order [R, world C]; other ranks: None."""
        if self.world == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self._wait(self.dev_pg.gather([parts] if self.rank == 0 else [], [x], opts))
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0's ``payload`` on every rank: one fixed-size broadcast (a second for what does not fit)."""
        buf = self._cmd
        if self.rank == 0:
            head = struct.pack("<Q", len(payload)) + payload[:COMMAND_BYTES - 8]
            buf[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self._wait(self.pg.broadcast([buf], dist.BroadcastOptions()))
        (n,) = struct.unpack("<Q", bytes(buf[:8].tolist()))
        if n <= COMMAND_BYTES - 8:
            return payload if self.rank == 0 else bytes(buf[8:8 + n].numpy())
        rest = n - (COMMAND_BYTES - 8)
        extra = (torch.frombuffer(bytearray(payload[COMMAND_BYTES - 8:]), dtype=torch.uint8) if self.rank == 0
                 else torch.empty(rest, dtype=torch.uint8))
        self._wait(self.pg.broadcast([extra], dist.BroadcastOptions()))
        return payload if self.rank == 0 else bytes(buf[8:].numpy()) + bytes(extra.numpy())

    def broadcast_obj(self, obj=None):
        return pickle.loads(self.broadcast_bytes(pickle.dumps(obj) if self.rank == 0 else None))

    def count(self, flags: list[int]) -> list[int]:
        """Each element of ``flags`` summed over ranks, on every rank (integers over gloo: exact)."""
        if self.world == 1:
            return list(flags)
        t = torch.tensor(list(flags) + [0], dtype=torch.int64)
        self._wait(self.pg.allreduce([t], dist.AllreduceOptions()))
        return t[:-1].tolist()

    def barrier(self) -> None:
        if self.world > 1:
            self._wait(self.pg.barrier())

    def close(self) -> None:
        """Drop the group (its sockets close; peers blocked in a collective get an error)."""
        self.closed = True
        for pg in {id(p): p for p in (self.dev_pg, self.pg) if p is not None}.values():
            try:
                pg.abort()
            except (AttributeError, RuntimeError):
                pass
        self.pg = self.dev_pg = self.store = None


# -- the sharded decoder ---------------------------------------------------------------------
def _part(t: torch.Tensor | None, dim: int, start: int, stop: int) -> torch.Tensor | None:
    """A copy of ``t[start:stop]`` along ``dim`` (not a view: the whole tensor can be freed)."""
    if t is None:
        return None
    if start == 0 and stop == t.shape[dim]:  # a pre-sharded checkpoint's tensor: already this rank's
        return t.detach()
    return t.detach().narrow(dim, start, stop - start).clone()


def _lin(w: torch.Tensor, b: torch.Tensor | None = None) -> SimpleNamespace:
    return SimpleNamespace(weight=w, bias=b, out_features=w.shape[0])


def shard_view(hf_model, rank: int, tp: int, first: int = 0, last: int | None = None) -> SimpleNamespace:
    """The weights rank ``rank`` of ``tp`` holds, shaped as the module tree :class:`DecoderModel` reads, with a
    config of the local head, KV-head, intermediate and vocabulary counts. Row-parallel biases are left out (added
    once after the reduction: :class:`RowParallel`)."""
    cfg = hf_model.config
    spec = DecoderSpec.from_config(cfg)
    problems = check_shardable(cfg, tp)
    if problems:
        raise ValueError("; ".join(problems))
    Hq, Hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    qs, kvs = q_heads_of(Hq, Hkv, tp, rank), kv_heads_of(Hkv, tp, rank)
    hq = len(qs)
    inter = cfg.intermediate_size // tp
    V = cfg.vocab_size // tp
    last = spec.num_layers if last is None else last
    inner = hf_model.model
    layers = [None] * spec.num_layers
    for i in range(first, last):
        a, m = inner.layers[i].self_attn, inner.layers[i].mlp
        q0, k0, k1 = qs.start * d, kvs.start * d, kvs.stop * d
        attn = SimpleNamespace(
            q_proj=_lin(_part(a.q_proj.weight, 0, q0, q0 + hq * d), _part(a.q_proj.bias, 0, q0, q0 + hq * d)),
            k_proj=_lin(_part(a.k_proj.weight, 0, k0, k1), _part(a.k_proj.bias, 0, k0, k1)),
            v_proj=_lin(_part(a.v_proj.weight, 0, k0, k1), _part(a.v_proj.bias, 0, k0, k1)),
            o_proj=_lin(_part(a.o_proj.weight, 1, q0, q0 + hq * d)),
            q_norm=getattr(a, "q_norm", None), k_norm=getattr(a, "k_norm", None))
        i0 = rank * inter
        mlp = SimpleNamespace(
            gate_proj=_lin(_part(m.gate_proj.weight, 0, i0, i0 + inter), _part(m.gate_proj.bias, 0, i0, i0 + inter)),
            up_proj=_lin(_part(m.up_proj.weight, 0, i0, i0 + inter), _part(m.up_proj.bias, 0, i0, i0 + inter)),
            down_proj=_lin(_part(m.down_proj.weight, 1, i0, i0 + inter)))
        layers[i] = SimpleNamespace(self_attn=attn, mlp=mlp, input_layernorm=inner.layers[i].input_layernorm,
                                    post_attention_layernorm=inner.layers[i].post_attention_layernorm)
    v0 = rank * V
    embed = (SimpleNamespace(weight=_part(inner.embed_tokens.weight, 0, v0, v0 + V)) if first == 0 else None)
    is_last = last == spec.num_layers
    head = hf_model.lm_head if is_last else None
    lm_head = (_lin(_part(head.weight, 0, v0, v0 + V), _part(getattr(head, "bias", None), 0, v0, v0 + V))
               if is_last else None)
    local = copy.copy(cfg)
    local.num_attention_heads, local.num_key_value_heads, local.head_dim = hq, len(kvs), d
    local.intermediate_size, local.vocab_size = inter, V
    return SimpleNamespace(config=local, lm_head=lm_head, model=SimpleNamespace(
        layers=layers, embed_tokens=embed, norm=inner.norm if is_last else None, rotary_emb=inner.rotary_emb))


class RowParallel:
    """A row-parallel linear: this rank's columns of W times its slice of x, summed over ranks (fixed order),
    plus the bias once. Anything else (``lib``, ``native_w`` ...) is the local linear's."""

    def __init__(self, local, group: FixedOrderGroup, bias: torch.Tensor | None):
        self.local, self.group, self.full_bias = local, group, bias
        self.in_features = local.in_features

    def __getattr__(self, name):
        return getattr(self.__dict__["local"], name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.local(x))

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's partial output y [N, out] summed over ranks (fixed order), plus the bias once."""
        y = self.group.sum(y)
        return y + self.full_bias if self.full_bias is not None else y


class TPDecoderModel(DecoderModel):
    """Rank ``group.rank``'s shard of layers ``[first, last)`` of a Llama-family decoder (docs/tensor_parallel.md).
    ``forward`` returns the full hidden states [N, D] on every rank; ``logits`` the full [R, V] on rank 0 and an
    empty [R, 0] elsewhere. ``config`` and ``full_spec`` are the whole model's; ``spec`` is this rank's."""

    def __init__(self, hf_model, group: FixedOrderGroup, first: int = 0, last: int | None = None,
                 compile: bool = False):
        pre = getattr(hf_model.config, "tp_shard", None)
        if pre is not None and pre != (group.rank, group.world):
            raise ValueError(f"weights read for rank {pre[0]} of {pre[1]} given to rank {group.rank} of {group.world}")
        # weights read per rank (local_config, shard_slicer) are already this rank's: sliced "over one rank"
        view = shard_view(hf_model, 0, 1, first, last) if pre else shard_view(hf_model, group.rank, group.world,
                                                                               first, last)
        full = hf_model.config.full_config if pre else hf_model.config
        super().__init__(view, first, last, compile, graphs=False)  # CUDA graphs would capture the collectives
        self.stack = None  # the native stack runs every layer in one call: no place for the reductions
        self.full_spec = DecoderSpec.from_config(full)
        self.config = full
        self.tp_rank, self.tp_size = group.rank, group.world
        self.vocab_start = group.rank * view.config.vocab_size
        self.local_vocab = view.config.vocab_size
        inner = hf_model.model
        biases = {}
        for i in range(self.first, self.last):
            a, m = inner.layers[i].self_attn, inner.layers[i].mlp
            biases[i] = tuple(b.detach().clone() if b is not None else None
                              for b in (a.o_proj.bias, m.down_proj.bias))
        self._row_biases = biases
        self.set_group(group)

    def set_group(self, group: FixedOrderGroup) -> None:
        """Use ``group`` for the reductions (a restarted group: the same rank and size, the shard unchanged)."""
        if (group.rank, group.world) != (self.tp_rank, self.tp_size):
            raise ValueError(f"rank {group.rank} of {group.world} given to the shard of rank {self.tp_rank} "
                             f"of {self.tp_size}")
        self.group = group
        for i, w in zip(range(self.first, self.last), self.layers):
            ob, db = self._row_biases[i]
            w.o = RowParallel(w.o.local if isinstance(w.o, RowParallel) else w.o, group, ob)
            w.down = RowParallel(w.down.local if isinstance(w.down, RowParallel) else w.down, group, db)

    def layer_linears(self):
        return [getattr(f, "local", f) for w in self.layers for f in (w.qkv, w.o, w.gate_up, w.down)]

    def adapter_base(self):
        return self.full_spec, self.config.intermediate_size

    def adapter_shard(self):
        """LoRA factors cut as this rank's base weights are (lora.shard_factors): the same rows and columns."""
        return shard_slicer(self.config, self.tp_rank, self.tp_size)

    def lora_linear(self, f, x, lora, layer, name):
        """Row-parallel (o, down): this rank's partial output plus its partial LoRA delta (A's columns of its
        input slice), then the one fixed-order sum; column-parallel: its own output rows, delta included."""
        if isinstance(f, RowParallel):
            return f.reduce(add_lora(f.local(x), x, lora, layer, name))
        return add_lora(f(x), x, lora, layer, name)

    def forward(self, batch, pool, hidden=None, on_layer=None):
        if on_layer is not None:
            raise ValueError("exit heads read the hidden states mid-forward: not with tensor_parallel_size > 1")
        return super().forward(batch, pool, hidden)

    def embed_rows(self, input_ids: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        """Vocabulary-parallel: each rank looks up the ids in its rows (zeros for the others'), summed over ranks
        (exact: one nonzero addend per element)."""
        if not self.is_first:
            return hidden.to(self.device, self.dtype)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.local_vocab)
        e = F.embedding(local.clamp(0, self.local_vocab - 1), self.embed).masked_fill(~mine[:, None], 0)
        return self.group.sum(e)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel head: this rank's [R, V / tp], gathered side by side on rank 0 ([R, 0] elsewhere)."""
        local = self.lm_head(self.glue.norm(hidden, self.norm, self.spec.rms_eps))
        full = self.group.gather_cols(local)
        return full if full is not None else local[:, :0]
