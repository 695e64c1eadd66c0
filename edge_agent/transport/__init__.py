"""How the edge reaches a verifier: the :class:`Transport` interface (:mod:`.base`), over
HTTP/WebSocket (:mod:`.http`), or an engine in this process (:mod:`.local`). The agent's logic is
the same over every one."""

from edge_agent.transport.base import ModelInfo, Transport
from edge_agent.transport.http import HttpTransport, RetryPolicy, is_app_error
from edge_agent.transport.local import LocalTransport

__all__ = ["HttpTransport", "LocalTransport", "ModelInfo", "RetryPolicy", "Transport", "is_app_error"]
