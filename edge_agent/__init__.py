"""The edge agent: local draft model, tree + proactive drafting, adaptive depth, client, CLI.

Python API::

    from edge_agent import EdgeAgent, AgentConfig, HttpTransport, ModelDrafter
    agent = EdgeAgent(HttpTransport(url, api_key=key), ModelDrafter(draft_model), tokenizer)
    result = await agent.generate("Hello", {"max_tokens": 64})

Modules (docs/edge_agent.md has the map): :mod:`~edge_agent.agent` (one generation),
:mod:`~edge_agent.tree_rounds` / :mod:`~edge_agent.chain_rounds` (the verify rules' rounds) over
:mod:`~edge_agent.link` (the session), :mod:`~edge_agent.tree_session` (the draft-session protocol),
:mod:`~edge_agent.draft_session` (proactive drafting and reuse, SpecEdge §4.2), :mod:`~edge_agent.depth`
(server pacing §4.3 + FlexSpec §IV-B), :mod:`~edge_agent.transport` (HTTP/WebSocket and in-process),
:mod:`~edge_agent.cli`. Installs with ``pip install '.[edge]'`` (no Ray, no Serve).
"""

from __future__ import annotations

_EXPORTS = {
    "EdgeAgent": "edge_agent.agent", "AgentConfig": "edge_agent.config", "GenerationResult": "edge_agent.stats",
    "GenerationStats": "edge_agent.stats", "ModelDrafter": "edge_agent.draft_backends",
    "NgramDrafter": "edge_agent.draft_backends", "NullDrafter": "edge_agent.draft_backends",
    "HttpTransport": "edge_agent.transport", "LocalTransport": "edge_agent.transport",
    "Transport": "edge_agent.transport", "TreeConfig": "edge_agent.tree_builder",
    "DepthPolicy": "edge_agent.depth",
}


def __getattr__(name: str):  # lazy: `import edge_agent` stays cheap (no torch until needed)
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'edge_agent' has no attribute {name!r}")


__all__ = list(_EXPORTS)
