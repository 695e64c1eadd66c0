"""The native kernels (``csrc/``: tree attention, bf16 glue, bf16 linear, the layer stack in one call), built once with
the system C compiler, loaded with ctypes; :func:`load` is ``None`` without one or with ``SPECEDGE_NATIVE=0``."""

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

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(CSRC / name for name in ("tree_attention.c", "glue.c", "linear.c", "decoder.c"))
HEADERS = (CSRC / "bf16_math.h",)
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
        subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", tmp, "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, out)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"building the native kernels failed: {e.stderr.strip()[-2000:]}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or ``None`` when it cannot be built here."""
    if os.environ.get("SPECEDGE_NATIVE", "1") == "0":
        return None
    from specdec.model.loading import cache_dir

    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join(FLAGS).encode()
                         + _cpu_flags().encode()).hexdigest()[:16]
    path = cache_dir() / "native" / f"specedge-kernels-{key}.so"
    try:
        if not path.exists():
            _build(path)
        lib = ctypes.CDLL(str(path))
    except (RuntimeError, OSError) as e:
        log.warning("native kernels unavailable (%s); using the torch attention and glue", e)
        return None
    p, i32, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    for name in ("tree_attention_bf16", "tree_attention_f32"):
        fn = getattr(lib, name)
        fn.restype = i32
        fn.argtypes = [p, p, p, p, i32, p, p, p, p, i32, i32, i32, i32, f32, i32, i32]
    lib.glue_add_rms_norm_bf16.argtypes = [p, p, p, p, p, i32, i32, f32, i32]
    lib.glue_rope_kv_bf16.argtypes = [p, p, p, p, p, p, p, p, i32, i32, i32, i32, i32]
    lib.glue_swiglu_bf16.argtypes = [p, p, i32, i32, i32]
    lib.linear_bf16_pack.argtypes = [p, p, i32, i32]
    lib.linear_bf16.argtypes = [p, p, p, p, i32, i32, i32, i32]
    lib.linear_bf16.restype = lib.linear_bf16_supported.restype = i32
    i64 = ctypes.c_int64
    lib.decoder_layers_bf16.argtypes = [p, i32, p, i32, i32, i32, i32, i32, i32, f32, f32, p, p, p, p, i64, p, p, p,
                                        i32, p, p, p, i32, i32]
    lib.decoder_layers_bf16.restype = i32
    lib.glue_argmax_bf16.argtypes = [p, ctypes.c_int64]
    lib.glue_argmax_bf16.restype = ctypes.c_int64
    for name in ("glue_add_rms_norm_bf16", "glue_rope_kv_bf16", "glue_swiglu_bf16", "linear_bf16_pack"):
        getattr(lib, name).restype = None
    return lib
