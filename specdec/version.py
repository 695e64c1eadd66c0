"""The installed ``specedge-serve`` version (``edge-agent --version``, ``GET /v1/model``, vLLM's ``GET /version``)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

PACKAGE = "specedge-serve"


def package_version() -> str:
    """The installed distribution's version, or ``0+unknown`` when run from an uninstalled tree."""
    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        return "0+unknown"
