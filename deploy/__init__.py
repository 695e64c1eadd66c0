"""Cloud side of edge-drafted, cloud-verified speculative decoding.

``serve run deploy.app`` imports :data:`app` (the default application, built lazily so
that the pure engine modules import without Ray, for the edge agent and for tests);
config files use the builder ``deploy:build_app`` with ``args``. Both live in
:mod:`deploy.application`.
"""


def __getattr__(name):
    if name == "app":
        from deploy.application import build_app

        return build_app()
    if name == "build_app":
        from deploy.application import build_app

        return build_app
    raise AttributeError(name)
