"""The edge agent: local draft model, tree + proactive drafting, adaptive depth, client, CLI.
Notes: docs/edge_agent.md, "edge_agent/__init__.py"."""

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
