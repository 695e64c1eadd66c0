"""The router's verifier in its own replica: the ``colocated`` topology (``AppConfig.topology``).

In the ``split`` topology the router (ingress) calls the verifier replicas through a Serve
deployment handle: ``handle.<method>.remote(**kw)`` awaited, or, for a stream,
``handle.options(stream=True).<method>.remote(**kw)`` iterated. Every verify round then pays
one Serve request twice over: the handle's routing and gRPC call in the router, the request
handling in the verifier replica (``benchmarks.run``'s CPU split measures it per token).

With one verifier replica on one machine nothing needs that hop: the router replica builds the
verifier itself (:class:`deploy.verifier.deployment.VerifierDeployment`) and calls it through
:class:`InProcessVerifier`, which answers the same two call forms by running the verifier's
coroutine on the replica's own event loop. Its batch loop and forward thread are the verifier's
own, unchanged. Cancellation carries over: cancelling the awaiting task (a client gone, a
timeout) cancels the verifier's coroutine, as Serve cancels a request on its replica.
Arguments and results are passed by reference, not copied: the verifier's methods take
immutable frames and answer fresh ``(status, payload)`` tuples.
"""

from __future__ import annotations


class _Method:
    """``handle.<method>``: ``remote(**kwargs)`` starts the call (a coroutine, or for a streaming
    method an async generator)."""

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
