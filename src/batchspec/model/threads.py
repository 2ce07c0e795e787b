"""The OpenMP worker threads that torch's CPU ops and the C kernels run their parallel regions on.

libgomp keeps a pool of workers for each thread that has opened a parallel region, and once the process holds more
workers than CPUs it lets idle workers spin only briefly before they sleep, so that every later parallel region
wakes its workers through the kernel: short ops then take several times as long. A server loads its model on one
thread and steps the engine on another; the loading thread's idle pool alone is enough to tip the engine thread's
pool into that regime on a small machine. ``release_idle_workers`` ends the calling thread's pool (OpenMP 5's
``omp_pause_resource_all``); the thread gets a new one the next time it runs a parallel op.
"""

from __future__ import annotations

import ctypes
import os

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t's soft pause (OpenMP 5.0): the calling thread's workers end


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process already runs (torch's own copy), never a second one loaded here."""
    try:
        return ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except (OSError, AttributeError):  # not loaded (another OpenMP runtime), or no RTLD_NOLOAD on this platform
        return None


def release_idle_workers() -> bool:
    """End the OpenMP workers of the calling thread's pool; False where this process runs no libgomp that can."""
    lib = _libgomp()
    if lib is None or not hasattr(lib, "omp_pause_resource_all"):
        return False
    return lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
