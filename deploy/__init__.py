"""Cloud side of edge-drafted, cloud-verified speculative decoding.

``serve run deploy.app`` imports :data:`app` (built lazily, so the pure engine modules
import without Ray for the edge agent and for tests).
"""


def __getattr__(name):
    if name == "app":
        from deploy.app import build_app

        return build_app()
    raise AttributeError(name)
