"""A tensor-parallel group behind the :class:`~specdec.model.runner.ModelRunner` interface (issue 64).

Rank 0 runs in the caller's process (the replica, or a pipeline stage) and is :class:`TPRunner`; ranks 1..N-1 are
workers (:func:`serve_rank`) started by a launcher: :class:`ProcessLauncher` (processes, here and in tests) or
``deploy.verifier.tensor_parallel.RayLauncher`` (Ray actors in the replica's placement group). Each round rank 0
broadcasts one command (the KV bookkeeping queued since the last forward, then the forward's items); every rank
packs the same batch on its own pool (the pools go through the same operations, so their pages agree), runs its
shard, and the logits are gathered on rank 0. A collective that fails (a rank died) takes the group down: rank 0
closes it, starts the workers again and raises :class:`~specdec.errors.KVStateLost` naming every session, which
the engine closes and whose edges re-open from their histories. docs/tensor_parallel.md."""

from __future__ import annotations

import logging
import os
import socket
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch

from specdec.errors import KVStateLost
from specdec.model.loading import LoadedModel
from specdec.model.lora import fingerprint
from specdec.model.runner import ModelRunner
from specdec.model.tensor_parallel import FixedOrderGroup, GroupLost, TPDecoderModel

log = logging.getLogger(__name__)

# the runner's KV operations a worker replays, in order, before the next forward
QUEUED_OPS = ("commit", "abort", "drop", "truncate", "hold", "share_prefix", "cache_prefix")


class TPStartError(RuntimeError):
    """A tensor-parallel worker could not start (its own error, when it could say)."""


@dataclass
class ShardSpec:
    """What every rank builds: ``load()`` gives the target's weights (an HF-shaped module tree; each rank keeps its
    shard of them), layers ``[first, last)``, the pool, the threads each rank runs."""

    load: Callable
    first: int = 0
    last: int | None = None
    kv_capacity_tokens: int = 1 << 16
    prefix_caching: bool = False
    compile: bool = False
    threads: int = 1
    timeout_s: float = 120.0
    cpu_affinity: dict = field(default_factory=dict)  # rank -> CPUs (processes only)
    load_shard: bool = False  # load(rank, tp): the loader reads only that rank's part (checkpoint.read_weights)
    device: str = "cpu"  # cuda: the tensors' collectives over NCCL (each rank's own GPU)


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def build_shard(spec: ShardSpec, group: FixedOrderGroup, model=None) -> ModelRunner:
    """This rank's runner: its shard of ``spec.load()`` (or ``model``, a shard kept from an earlier group)."""
    info = None
    if model is None:
        weights = spec.load(group.rank, group.world) if spec.load_shard else spec.load()
        if isinstance(weights, LoadedModel):  # the target's metadata, without the weights
            m = weights.model
            info = LoadedModel(SimpleNamespace(config=m.config, generation_config=getattr(m, "generation_config", None)),
                               weights.tokenizer, weights.name, weights.eos_token_ids, weights.device, weights.dtype)
            weights = m
        model = TPDecoderModel(weights, group, spec.first, spec.last, spec.compile)
        del weights  # only the shard stays
    else:
        model.set_group(group)
    runner = ModelRunner(model, kv_capacity_tokens=spec.kv_capacity_tokens, compile=spec.compile,
                         prefix_caching=spec.prefix_caching)
    runner.loaded = info  # type: ignore[attr-defined]
    return runner


def serve_rank(addr: str, port: int, rank: int, world: int, spec: ShardSpec) -> None:
    """A worker rank: join the group, load the shard (an error goes to the store for rank 0 to report), then
    apply rank 0's commands until told to stop or the group fails. Exits the process on failure."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    cpus = spec.cpu_affinity.get(rank)
    if cpus:
        os.sched_setaffinity(0, cpus)
    group = FixedOrderGroup.connect(addr, port, rank, world, spec.timeout_s, spec.device)
    group.store.set(f"tp/pid/{rank}", str(os.getpid()))
    try:
        runner = build_shard(spec, group)
    except Exception:  # noqa: BLE001 - any load failure: reported by rank 0 as the group's start error
        group.store.set(f"tp/error/{rank}", traceback.format_exc()[-4000:])
        os._exit(1)
    held: dict = {}  # LoRA version -> (path, fingerprint) this rank holds
    try:
        group.barrier()
        while True:
            queued, cmd = group.broadcast_obj()
            for op, args in queued:
                getattr(runner, op)(*args)
            if cmd is None:
                continue
            if cmd[0] == "stop":
                break
            if cmd[0] == "adapters":
                hold_adapters(runner.model, group, cmd[1], held)
            if cmd[0] == "forward":
                try:
                    runner.forward(*cmd[1:])
                except GroupLost:
                    raise
                except Exception:  # noqa: BLE001 - rank 0 meets the same error at the same point (a full pool)
                    pass
    except GroupLost:
        os._exit(3)  # rank 0 is gone or closed the group: it starts a new one
    group.close()


def hold_adapters(model, group: FixedOrderGroup, specs: dict[str, tuple], held: dict) -> None:
    """A worker's side of :meth:`TPRunner.sync_adapters`: hold exactly ``specs``'s versions (name -> (path,
    fingerprint)), each its shard, loading those new or changed; then one count of the ranks that could not load
    each (sorted by name; the reason in the store under ``tp/adapter/<name>``)."""
    keep, fails = {}, []
    for name in sorted(specs):
        path, fp = specs[name]
        try:
            if held.get(name) == specs[name] and name in model.adapters:
                keep[name] = model.adapters[name]
            elif fingerprint(path) != fp:
                raise ValueError(f"{path} changed on disk since rank 0 read it")
            else:
                keep[name] = model.load_adapter(name, path)
            fails.append(0)
        except Exception as e:  # noqa: BLE001 - this version only: rank 0 marks it unavailable
            group.store.set(f"tp/adapter/{name}", f"rank {group.rank}: {type(e).__name__}: {e}"[:1000])
            fails.append(1)
    model.adapters = keep
    held.clear()
    held.update({n: specs[n] for n in keep})
    group.count(fails)


def _process_main(addr, port, rank, world, spec):
    serve_rank(addr, port, rank, world, spec)
    os._exit(0)


class ProcessLauncher:
    """Workers as local processes (spawned): tests, benchmarks, a replica without Ray."""

    def __init__(self):
        self.procs = []

    def address(self) -> str:
        return "127.0.0.1"

    def start(self, addr: str, port: int, world: int, spec: ShardSpec) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_process_main, args=(addr, port, r, world, spec), daemon=True)
                      for r in range(1, world)]
        for p in self.procs:
            p.start()

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def failed(self) -> str | None:
        """Why a worker is gone before joining (its exit code), or None."""
        dead = [(i + 1, p.exitcode) for i, p in enumerate(self.procs) if p.exitcode is not None]
        return f"worker rank(s) exited: {dead}" if dead else None

    def stop(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            if p.pid is not None:  # one whose start failed was never started: nothing to join
                p.join(timeout=10)
        self.procs = []


class TPRunner:
    """Rank 0 of a tensor-parallel group, as a :class:`ModelRunner` (the engine's ``runner``)."""

    def __init__(self, spec: ShardSpec, world: int, launcher=None, model=None):
        self.spec, self.world = spec, world
        self.launcher = launcher if launcher is not None else ProcessLauncher()
        self.restarts = 0
        self.broken: str | None = None  # why the group could not be started again after a loss
        self.local: ModelRunner | None = None
        self.group: FixedOrderGroup | None = None
        self._queued: list = []
        self._adapters: dict = {}  # the LoRA versions every worker holds: name -> (path, fingerprint)
        self._loss: GroupLost | None = None  # a collective outside a forward failed: the next forward restarts
        self._start(model)
        self.loaded = self.local.loaded  # LoadedModel without weights (when spec.load gives a LoadedModel), or None

    # -- the group ---------------------------------------------------------------------------
    def _start(self, model=None) -> None:
        """Start the workers, join them (rank 0), load this rank's shard unless kept, wait until all are loaded."""
        if self.spec.threads:
            torch.set_num_threads(self.spec.threads)
        addr = self.launcher.address()
        port = free_port(addr)
        try:
            self.launcher.start(addr, port, self.world, self.spec)
            self.group = FixedOrderGroup.connect(addr, port, 0, self.world, self.spec.timeout_s, self.spec.device)
            keep = model if model is not None else (self.local.model if self.local is not None else None)
            loaded = self.local.loaded if self.local is not None else None
            self.local = build_shard(self.spec, self.group, keep)
            self.local.loaded = self.local.loaded or loaded
            self.group.barrier()
            self.worker_pids = [int(self.group.store.get(f"tp/pid/{r}")) for r in range(1, self.world)]
        except Exception as e:  # noqa: BLE001 - one message, nothing left running
            why = self._worker_errors() or (self.launcher.failed() if hasattr(self.launcher, "failed") else None)
            self._teardown()
            raise TPStartError(f"tensor-parallel group of {self.world} ranks did not start: "
                               f"{why or f'{type(e).__name__}: {e}'}") from None
        self._queued, self._adapters, self._loss = [], {}, None  # new workers hold no LoRA version

    def _worker_errors(self) -> str | None:
        if self.group is None or self.group.store is None:
            return None
        out = []
        for r in range(1, self.world):
            key = f"tp/error/{r}"
            try:
                if self.group.store.check([key]):
                    out.append(f"rank {r}: {self.group.store.get(key).decode().strip().splitlines()[-1]}")
            except RuntimeError:
                pass
        return "; ".join(out) or None

    def _teardown(self) -> None:
        if self.group is not None:
            self.group.close()
        self.launcher.stop()

    def _lost(self, e: GroupLost):
        """The group failed: close it, start it again (this rank keeps its shard), drop every session's KV."""
        lost = sorted(self.local.pool.sessions)
        log.warning("tensor-parallel group lost (%s): restarting it; %d sessions re-open from history", e, len(lost))
        self._teardown()
        try:
            self._start()
        except TPStartError as start:  # the replica's health check fails from now on: Serve replaces it
            self.broken = str(start)
            raise
        self.restarts += 1
        raise KVStateLost(f"a tensor-parallel rank was lost ({e}); the group restarted and its sessions' KV is "
                          f"gone: re-open from history", sessions=lost)

    def tp_stats(self) -> dict:
        """The group: its size, restarts so far, the workers' process ids (rank 1 first)."""
        return {"tensor_parallel_size": self.world, "restarts": self.restarts, "worker_pids": list(self.worker_pids)}

    def shutdown(self) -> None:
        if self.group is not None and not self.group.closed:
            try:
                self.group.broadcast_obj((self._queued, ("stop",)))
            except GroupLost:
                pass
        self._teardown()

    # -- rounds ----------------------------------------------------------------------------
    def forward(self, batch_id: int, items, hidden: torch.Tensor | None = None, on_layer=None):
        if on_layer is not None:
            raise ValueError("exit heads need tensor_parallel_size 1")
        if self.broken:
            raise RuntimeError(f"the tensor-parallel group is down: {self.broken}")
        if self._loss is not None:
            self._lost(self._loss)
        queued, self._queued = self._queued, []
        try:
            self.group.broadcast_obj((queued, ("forward", batch_id, items, hidden)))
            return self.local.forward(batch_id, items, hidden)
        except GroupLost as e:
            self._lost(e)

    def sync_adapters(self, specs: dict[str, tuple]) -> dict[str, str]:
        """Make every worker hold the LoRA versions of ``specs`` (name -> (path, fingerprint); rank 0's registry
        holds them already), each its shard, and no other. One broadcast and one count, only when ``specs`` changed
        since the last call or the group restarted. Returns {name: why} for versions a worker could not load."""
        if specs == self._adapters or self.broken or self._loss is not None:
            return {}
        names = sorted(specs)
        queued, self._queued = self._queued, []
        try:
            self.group.broadcast_obj((queued, ("adapters", dict(specs))))
            counts = self.group.count([0] * len(names))
        except GroupLost as e:  # the next forward restarts the group (its KVStateLost closes the sessions)
            self._loss = e
            return {}
        failed = {n: self._adapter_error(n) for n, c in zip(names, counts) if c}
        self._adapters = {n: s for n, s in specs.items() if n not in failed}
        return failed

    def _adapter_error(self, name: str) -> str:
        key = f"tp/adapter/{name}"
        try:
            why = self.group.store.get(key).decode()
            self.group.store.delete_key(key)
        except RuntimeError:
            why = "a worker could not load it"
        return why

    def flush(self) -> None:
        """Send the queued KV operations now (a forward carries them otherwise)."""
        if self._queued:
            queued, self._queued = self._queued, []
            try:
                self.group.broadcast_obj((queued, None))
            except GroupLost as e:
                self._lost(e)

    def _op(self, op: str, *args):
        out = getattr(self.local, op)(*args)
        self._queued.append((op, args))
        return out

    def commit(self, batch_id, keep):
        return self._op("commit", batch_id, keep)

    def abort(self, batch_id):
        return self._op("abort", batch_id)

    def hold(self, batch_id):
        return self._op("hold", batch_id)

    def drop(self, sid):
        return self._op("drop", sid)

    def truncate(self, sid, length):
        return self._op("truncate", sid, length)

    def share_prefix(self, sid, tokens, salt=None):
        return self._op("share_prefix", sid, tokens, salt)

    def cache_prefix(self, sid, tokens, salt=None):
        return self._op("cache_prefix", sid, tokens, salt)

    # -- what rank 0 answers alone (every rank's pool agrees) ---------------------------------
    def kv_length(self, sid):
        return self.local.kv_length(sid)

    def kv_tokens(self):
        return self.local.kv_tokens()

    def kv_used_tokens(self):
        return self.local.kv_used_tokens()

    def prefix_stats(self):
        return self.local.prefix_stats()

    def session_kv(self, sid):
        """Rank 0's KV heads of a session (the KV heads are split over ranks)."""
        return self.local.session_kv(sid)

    @property
    def pool(self):
        return self.local.pool

    @property
    def model(self):
        return self.local.model

    def __getattr__(self, name):  # first, last, is_first, is_last, dtype, device: the local runner's
        if name in ("first", "last", "is_first", "is_last", "dtype", "device"):
            return getattr(self.__dict__["local"], name)
        raise AttributeError(name)

