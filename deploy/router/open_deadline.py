"""The open deadline of one request (issue 56): ``x-open-deadline-s``, capped by ``open_deadline_s``. Pure module."""

from __future__ import annotations

DEADLINE_HEADER = "x-open-deadline-s"


def request_deadline(header: str | None, default_s: float) -> float:
    """The deadline of one open: the header's value in seconds if given (capped at ``default_s``:
    a client may ask for less, never more), else ``default_s``. A bad value raises ValueError."""
    if header is None:
        return default_s
    try:
        value = float(header)
    except ValueError:
        value = float("nan")
    if not value > 0:  # NaN too
        raise ValueError(f"{DEADLINE_HEADER} must be a positive number of seconds, got {header!r}")
    return min(value, default_s)
