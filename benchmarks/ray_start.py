"""Ray's fixed start-up limit, for harnesses that start a local Ray in a child process.

``ray.init(address="local")`` gives its node 30 s to register with the GCS, a constant in
``ray/_private/node.py``. On an idle core the whole start takes ~8 s; pinned to a core that
two busy processes share, ~17 s; on a loaded 2-core CI machine it exceeded the 30 s and the
run failed before serving anything. A harness that sees this message in its child's log
starts the child once more (a new process group, the failed one's Ray processes stopped):
:class:`benchmarks.run.Server`, :func:`loadtests.run.start_server` and the ``serve run`` test.
"""

from __future__ import annotations

from pathlib import Path

RAY_START_TIMEOUT = "The current node timed out during startup"


def ray_start_timed_out(log: Path) -> bool:
    """Whether the child's log shows Ray's node missing its start-up limit."""
    return RAY_START_TIMEOUT in log.read_text(errors="replace")
