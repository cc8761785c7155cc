"""CPU ranks keep freed host memory: a large tensor allocated again in every pass stops page-faulting."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from hybridflow.runtime import host_memory

GLIBC = platform.libc_ver()[0] == "glibc"
# Allocate, touch and free a 64 MiB tensor 10 times after a warm-up; report the minor faults per round.
PROBE = """
import json, resource, sys, torch
from hybridflow.runtime import host_memory
from hybridflow.runtime.worker import GroupWorker
GroupWorker(group=0, rank=0, world_size=1, device=sys.argv[1], specs=[], layouts=[]).setup()
applied = host_memory._applied
def rounds(n):
    for _ in range(n):
        torch.ones(16 << 20).sum()
rounds(2)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds(10)
print(json.dumps({"applied": applied, "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10}))
"""


def probe(policy: str, device: str = "cpu") -> dict[str, float]:
    """A fresh process whose one rank is set up on ``device`` under ``policy``."""
    env = {**os.environ, host_memory.ENV: policy, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE, device], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_a_cpu_rank_keeps_freed_memory_so_a_reallocated_tensor_stops_page_faulting() -> None:
    system, kept = probe("system"), probe("keep")
    assert not system["applied"] and kept["applied"]
    pages = (64 << 20) / 4096
    assert system["faults"] > 0.9 * pages  # glibc maps each 64 MiB block afresh: every page faults in again
    assert kept["faults"] < 0.01 * pages


def test_an_unknown_policy_names_the_variable_and_its_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(host_memory.ENV, "jemalloc")
    with pytest.raises(ValueError, match=r"HYBRIDFLOW_HOST_MALLOC='jemalloc'.*'keep'.*'system'"):
        host_memory.keep_freed_host_memory()


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_a_gpu_rank_leaves_malloc_alone() -> None:
    assert not probe("keep", device="cuda:0")["applied"]
