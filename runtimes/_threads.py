"""How many threads a run may use: ``GEIR_NUM_THREADS``, checked and clamped to the CPUs available."""

from __future__ import annotations

import os

from ..ir._errors import ExecutionError

__all__ = ["available_cpus", "num_threads"]


def available_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def num_threads() -> int:
    """Worker threads: ``GEIR_NUM_THREADS`` if set (at most the CPUs available), else those CPUs.

    Raises ExecutionError for a value that is not a positive integer.
    """
    cpus = available_cpus()
    configured = os.environ.get("GEIR_NUM_THREADS", "").strip()
    if not configured:
        return cpus
    try:
        wanted = int(configured)
    except ValueError:
        wanted = 0
    if wanted < 1:
        raise ExecutionError(f"GEIR_NUM_THREADS={configured[:40]!r}: expected a positive integer (threads per run, "
                             f"at most the {cpus} CPUs available), or unset it to use every CPU")
    return min(wanted, cpus)
