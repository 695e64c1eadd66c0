"""The tree-attention kernel (``csrc/tree_attention.c``): built once with the system C
compiler, loaded with ctypes.

The build is keyed by the source, the flags and the CPU's feature flags, cached under
:func:`deploy.verifier.models.cache_dir` (``native/``), written to a temporary file and
renamed, so concurrent processes (Ray replicas, test workers) never load a half-written
library. No compiler, or ``SPECEDGE_NATIVE=0``: :func:`load` returns ``None`` and the
engine uses the torch attention (correct, slower, not batch-invariant in bf16).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "tree_attention.c"
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
PAGE_SIZE = 16  # PS in the source


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _build(out: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, out)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"building {SOURCE.name} failed: {e.stderr.strip()[-2000:]}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or ``None`` when it cannot be built here."""
    if os.environ.get("SPECEDGE_NATIVE", "1") == "0":
        return None
    from deploy.verifier.models import cache_dir

    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    path = cache_dir() / "native" / f"tree_attention-{key}.so"
    try:
        if not path.exists():
            _build(path)
        lib = ctypes.CDLL(str(path))
    except (RuntimeError, OSError) as e:
        log.warning("tree-attention kernel unavailable (%s); using the torch attention", e)
        return None
    p, i32, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    for name in ("tree_attention_bf16", "tree_attention_f32"):
        fn = getattr(lib, name)
        fn.restype = i32
        fn.argtypes = [p, p, p, p, i32, p, p, p, p, i32, i32, i32, i32, f32, i32, i32]
    return lib
