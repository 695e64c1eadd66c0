"""Helpers for the tests that deploy apps on the session's Ray instance (``ray_session``)."""

from __future__ import annotations


def delete_app(name: str) -> None:
    """Delete a module's app without waiting for its replicas to finish shutting down (3 s on an
    idle host, up to 12 s on a loaded one, per app): the next module deploys under another name
    meanwhile, and ``ray_session`` shuts Serve down at the end. Every app name is unique."""
    from ray import serve

    serve.delete(name, _blocking=False)
