"""The router's verifier in its own replica: the ``colocated`` topology (``AppConfig.topology``).

:class:`InProcessVerifier` answers a handle's calls on this loop (docs/router.md, "The colocated topology")."""

from __future__ import annotations


class _Method:
    """``handle.<method>``: ``remote(**kwargs)`` starts the call (a coroutine or an async generator)."""

    __slots__ = ("_fn",)

    def __init__(self, fn):
        self._fn = fn

    def remote(self, **kwargs):
        return self._fn(**kwargs)


class InProcessVerifier:
    """A deployment-handle lookalike over a verifier replica object living in this process."""

    def __init__(self, replica):
        self.replica = replica

    def options(self, stream: bool = False) -> "InProcessVerifier":
        """Streaming or not, the call is the method's own (an async generator streams)."""
        return self

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):  # the replica's internals are not part of its handle
            raise AttributeError(name)
        return _Method(getattr(self.replica, name))
