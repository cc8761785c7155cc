"""What a CPU rank's malloc policy costs a training pass: glibc's defaults against ``hybridflow.runtime.host_memory``.

Forward + backward of ``tiny-qwen2-wide`` over the same 8,192 tokens (128 rows of 64) in micro batches of 512 to
8,192 tokens, one thread, each policy in a process of its own (mallopt lasts a process), the two interleaved
``--repeats`` times so both see the same machine load. Prints seconds per policy and micro batch (min-max), the
ratio system / keep of the medians and the minor page faults per pass.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/host_memory.py [--repeats 3]

Results: ``docs/benchmarks.md``, "Host memory kept on CPU ranks".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROWS, ROW_TOKENS = 128, 64
MICRO_ROWS = (8, 16, 32, 64, 128)

PROBE = """
import json, resource, sys, time, torch
from hybridflow.models.tiny import build_tiny_causal_lm
from hybridflow.runtime.host_memory import keep_freed_host_memory
keep_freed_host_memory()
torch.set_num_threads(1)
model = build_tiny_causal_lm("tiny-qwen2-wide", vocab_size=1024)
ids = torch.randint(2, 1000, (ROWS, ROW_TOKENS), generator=torch.Generator().manual_seed(0))
def step(rows):
    for start in range(0, ROWS, rows):
        model(input_ids=ids[start:start + rows]).logits.float().logsumexp(-1).mean().backward()
step(ROWS)  # warm-up: the heap grows to the largest micro batch once
out = {}
for rows in MICRO_ROWS:
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    step(rows)
    out[rows * ROW_TOKENS] = (time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
print(json.dumps(out))
"""


def measure(policy: str) -> dict[int, tuple[float, int]]:
    env = {**os.environ, "HYBRIDFLOW_HOST_MALLOC": policy, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    sizes = f"ROWS, ROW_TOKENS, MICRO_ROWS = {ROWS}, {ROW_TOKENS}, {MICRO_ROWS}\n"
    out = subprocess.run([sys.executable, "-c", sizes + PROBE], env=env, capture_output=True, text=True, check=True)
    return {int(k): (v[0], v[1]) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[int, tuple[float, int]]]] = {"system": [], "keep": []}
    for _ in range(args.repeats):
        for policy in runs:
            runs[policy].append(measure(policy))
    print(f"load average {os.getloadavg()[0]:.1f}; forward + backward over {ROWS * ROW_TOKENS} tokens, one thread")
    print("| micro batch (tokens) | glibc defaults (s) | kept (s) | system / keep | faults a pass, system / keep |")
    print("|---|---|---|---|---|")
    for tokens in (rows * ROW_TOKENS for rows in MICRO_ROWS):
        cells = []
        for policy in runs:
            seconds = [run[tokens][0] for run in runs[policy]]
            cells.append((min(seconds), max(seconds), statistics.median(seconds),
                          statistics.median(run[tokens][1] for run in runs[policy])))
        (s_lo, s_hi, s_med, s_faults), (k_lo, k_hi, k_med, k_faults) = cells
        print(f"| {tokens} | {s_lo:.3f}-{s_hi:.3f} | {k_lo:.3f}-{k_hi:.3f} | {s_med / k_med:.2f}x | "
              f"{s_faults:.0f} / {k_faults:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
