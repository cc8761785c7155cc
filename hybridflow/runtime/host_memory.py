"""Keep freed host memory in the process, so a CPU rank's activations stop page-faulting every micro batch.

glibc's malloc serves a request above its mmap threshold (128 KiB, rising to at most 32 MiB as such blocks are
freed) with a fresh ``mmap`` and unmaps it on ``free``. A CPU rank allocates its activations, logits and gradients
anew in every pass, so each large tensor's pages fault in again and the kernel zeroes them: on this project's 2-core
Xeon a 32 MiB fp32 output costs 8,192 minor faults, ~1.5 us each, and a (8192, 256) x (256, 1024) matmul runs at 105
GFLOP/s where it runs at 163 into a reused buffer (``docs/benchmarks.md``, "Host memory kept on CPU ranks"). Per
token, a large micro batch then costs more than a small one, which is neither the hardware's arithmetic nor what the
planner prices.

:func:`keep_freed_host_memory` turns glibc's mmap path off (``M_MMAP_MAX`` 0: every block comes from the heap, and a
freed one is reused) and raises the heap's trim threshold to ``TRIM_THRESHOLD_BYTES``, so the top of the heap is
only returned to the system beyond that. This is the policy PyTorch's own CPU launcher sets for jemalloc
(``torch.backends.xeon.run_cpu``: ``dirty_decay_ms`` and ``muzzy_decay_ms`` of 9e9, freed pages are never returned);
mallopt does it without an ``LD_PRELOAD``. The cost is resident memory: a rank keeps its peak.

CPU ranks call it when they build their engines (``GroupWorker.setup``); ranks on a GPU leave malloc as it is (their
tensors live on the device, pinned host buffers come from CUDA's allocator). ``HYBRIDFLOW_HOST_MALLOC=system`` keeps
glibc's defaults.
"""

from __future__ import annotations

import ctypes
import os
import platform

ENV = "HYBRIDFLOW_HOST_MALLOC"
CHOICES = ("keep", "system")
# mallopt parameter numbers (glibc malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# The free top of the heap beyond this goes back to the system; below it, it stays for the next pass.
TRIM_THRESHOLD_BYTES = 1 << 30

_applied = False


def host_malloc_policy() -> str:
    """The policy ``HYBRIDFLOW_HOST_MALLOC`` asks for: ``keep`` (the default) or ``system``."""
    value = os.environ.get(ENV, "keep").strip().lower() or "keep"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: use 'keep' (CPU ranks reuse freed memory, the default) or 'system' "
                         "(glibc's own mmap and trim thresholds)")
    return value


def keep_freed_host_memory() -> bool:
    """Make this process's glibc malloc reuse freed blocks instead of unmapping them (module docstring).

    Returns whether the policy is in force: False under ``HYBRIDFLOW_HOST_MALLOC=system`` or off glibc (musl, macOS,
    Windows have no mallopt to set). Idempotent; the setting lasts for the life of the process.
    """
    global _applied
    if host_malloc_policy() == "system" or platform.libc_ver()[0] != "glibc":
        return False
    if not _applied:
        libc = ctypes.CDLL(None)
        if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
            raise OSError("glibc mallopt refused M_MMAP_MAX=0 or M_TRIM_THRESHOLD; set "
                          f"{ENV}=system to run with malloc's defaults")
        _applied = True
    return True
