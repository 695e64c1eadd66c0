"""The edge's side of the protocol (:mod:`specdec.protocol`), as async calls: model info, open
(also re-open from history), verify (binary frames), close, ping. Implementations:
:mod:`edge_agent.transport.http` (HTTP/WebSocket), :mod:`edge_agent.transport.local` (an engine in
this process), :mod:`edge_agent.replica_transport` (a verifier replica in this process)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.protocol import OpenSession, ReplyFrame, SessionOpened, VerifyFrame


@dataclass(frozen=True)
class ModelInfo:
    model: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer_fingerprint: str
    max_tree_nodes: int
    max_tree_depth: int
    early_exit_layers: tuple[int, ...] = ()  # the server streams early results (F_EARLY) from these exits
    max_model_len: int | None = None  # the target's context (None: an older server did not say)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelInfo":
        return cls(str(d["model"]), int(d["vocab_size"]), tuple(int(e) for e in d.get("eos_token_ids", ())),
                   str(d.get("tokenizer_fingerprint", "none")), int(d.get("max_tree_nodes", 64)),
                   int(d.get("max_tree_depth", 32)), tuple(int(x) for x in d.get("early_exit_layers") or ()),
                   int(d["max_model_len"]) if d.get("max_model_len") else None)


class Transport:
    """The protocol, as async calls. Errors are :mod:`specdec.errors` / :mod:`edge_agent.errors`."""

    async def model_info(self) -> ModelInfo:
        raise NotImplementedError

    async def open(self, req: OpenSession) -> SessionOpened:
        raise NotImplementedError

    async def verify(self, sid: str, frame: VerifyFrame, on_early=None) -> ReplyFrame:
        """One round. ``on_early(EarlyFrame)`` gets the early results of an ``F_EARLY`` frame as
        they arrive, before the reply (WebSocket, in-process, and HTTP POST with ``stream_early``)."""
        raise NotImplementedError

    async def close(self, sid: str) -> None:
        raise NotImplementedError

    async def release(self, sid: str) -> None:
        """A session the server closed itself (``close_on_finish``): drop what this side holds
        for it, sending nothing."""

    async def ping(self) -> float:
        """Seconds for one network round trip (no model work)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        pass

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()
