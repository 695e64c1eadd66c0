"""Early frames from the replica's verify forward to the router (the early-exit paper §3, step 3).

:class:`EarlyStreams` queues each early result on its request for ``Verifier.verify_stream``; the reply comes last."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from deploy.config import EarlyExitConfig
from specdec.errors import InvalidRequest
from specdec.exit_heads import EarlyResult, ExitHeads
from specdec.protocol import EarlyFrame, VerifyFrame


def load_heads(cfg: EarlyExitConfig, hf_model, layers=None) -> ExitHeads | None:
    """The configured exit heads for ``hf_model`` (None when off); ``layers``: only these (a pipeline stage's)."""
    if not cfg.enabled:
        return None
    layers = cfg.layers if layers is None else layers
    if cfg.heads == "untrained":
        return ExitHeads.init(hf_model, layers, rank=8)
    return ExitHeads.load(cfg.heads, hf_model, layers)


class EarlyStreams:
    """Per in-flight request that asked for early results: its queue of encoded early frames."""

    def __init__(self, heads: ExitHeads | None):
        self.heads = heads
        self.queues: dict[str, asyncio.Queue] = {}
        self.frames_sent = 0

    @classmethod
    def attach(cls, engine, cfg: EarlyExitConfig, hf_model) -> "EarlyStreams":
        """Load the heads (if on) into ``engine``; early requests then get results mid-forward.
        Pipeline stages hold their own heads; the engine gets their layout."""
        from specdec.model.runner import ModelRunner

        if not cfg.enabled or isinstance(engine.runner, ModelRunner):
            heads = load_heads(cfg, hf_model)
        else:
            heads = getattr(engine.runner, "exit_heads", None)
            if heads is None:
                raise ValueError("early exits are on but the pipeline stages hold no exit heads "
                                 "(build the runner with early_exit)")
        engine.exit_heads = heads
        return cls(heads)

    def info(self) -> dict:
        return {"early_exit_layers": list(self.heads.layers)} if self.heads is not None else {}

    def accept(self, f: VerifyFrame) -> bool:
        """Whether ``f`` asks for early results; 400 if it does and this replica has no exits."""
        if f.early and self.heads is None:
            raise InvalidRequest("early results (F_EARLY) are off on this server: GET /v1/model lists "
                                 "early_exit_layers when they are on")
        return f.early

    def sink(self, loop: asyncio.AbstractEventLoop, sids) -> object | None:
        """The engine's ``on_early`` for a batch: runs on the worker thread, mid-forward."""
        queues = {sid: self.queues[sid] for sid in sids if sid in self.queues}
        if not queues:
            return None

        def on_early(results: list[EarlyResult]) -> None:
            for r in results:
                q = queues.get(r.sid)
                if q is not None:
                    data = EarlyFrame(r.prefix_len, r.layer, list(r.accepted), r.token, r.confidence).encode()
                    loop.call_soon_threadsafe(q.put_nowait, data)

        return on_early

    async def stream(self, sid: str, reply) -> AsyncIterator[tuple]:
        """``("early", frame bytes)`` items while ``reply`` (a coroutine) runs, then ``("final", status, payload)``."""
        q: asyncio.Queue = asyncio.Queue()
        self.queues[sid] = q
        task = asyncio.ensure_future(reply)
        try:
            while not task.done():
                get = asyncio.ensure_future(q.get())
                done, _ = await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
                if get in done:
                    self.frames_sent += 1
                    yield ("early", get.result())
                else:
                    get.cancel()
            status, payload = task.result()
            yield ("final", status, payload)
        finally:
            if self.queues.get(sid) is q:
                del self.queues[sid]
            if not task.done():
                task.cancel()
