"""Cloud side of edge-drafted, cloud-verified speculative decoding.

``serve run deploy.app`` imports :data:`app` (built lazily: no Ray at import); config files use ``deploy:build_app``."""


def __getattr__(name):
    if name == "app":
        from deploy.application import build_app

        return build_app()
    if name == "build_app":
        from deploy.application import build_app

        return build_app
    raise AttributeError(name)
