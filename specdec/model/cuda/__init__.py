"""The verifier's batch-invariant path on CUDA (bf16 / fp16 / fp32): Triton kernels (:mod:`.kernels`), fixed-row
GEMMs (:mod:`specdec.model.row_chunks`); why: docs/specdec.md. Never imported by the CPU install (no Triton)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def unsupported(capability: tuple[int, int] | None, triton: bool = True, name: str = "this GPU") -> str | None:
    """Why the Triton kernels cannot run on a card of ``capability`` (None: they can): Triton missing, or a card
    outside the classes they are compiled and checked for (:data:`.plan.CARD_CLASSES`)."""
    from specdec.model.cuda.plan import CARD_CLASSES

    if not triton:
        return "Triton is not installed"
    if capability not in CARD_CLASSES:
        cc = f"sm_{capability[0]}{capability[1]}" if capability else "no compute capability"
        return (f"{name} ({cc}) is not a card class the Triton kernels are compiled for "
                f"({', '.join(CARD_CLASSES.values())})")
    return None


def why_not(device: torch.device | str) -> str | None:
    """Why the Triton kernels do not run on ``device`` (None: they do)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    if not _triton_importable():
        return unsupported(None, triton=False)
    return _card_why_not(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _card_why_not(index: int) -> str | None:
    from specdec.model.cuda.plan import device_capability

    return unsupported(device_capability(torch.device("cuda", index)), name=torch.cuda.get_device_name(index))


def available(device: torch.device | str) -> bool:
    """Whether the Triton kernels run on ``device`` (a CUDA device of a supported card class, Triton installed)."""
    return torch.device(device).type == "cuda" and why_not(device) is None
