"""The host optimizer's rate: fused AdamW on fp32 CPU tensors, one thread, as an offloaded trainer steps it.

hybridflow's fsdp backend builds ``torch.optim.AdamW(..., fused=True)``; under FSDP2's ``CPUOffloadPolicy`` its
parameters, gradients and moments are CPU tensors, so each rank's step runs on the host, one thread a rank
(``OMP_NUM_THREADS=1``). The planner prices that step as every optimizer byte read and written once (``2 x (param +
grad + m + v)``, 32 bytes a parameter, as the device optimizer) at ``costs.HOST_OPTIMIZER_BYTES_S``; this measures
the rate. Prints the median seconds of a step over ``--steps`` after two warm-up steps, and bytes / second.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/host_optimizer.py [--params 67108864] [--tensors 32] [--steps 10]

Result: ``docs/benchmarks.md``, "The host optimizer's rate".
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

BYTES_PER_PARAM = 2 * 4 * 4  # param, gradient, exp_avg, exp_avg_sq (fp32), each read and written once


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--params", type=int, default=64 * 2**20, help="parameters in all (default 67,108,864)")
    parser.add_argument("--tensors", type=int, default=32, help="tensors they are split into (a model's layers)")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    size = args.params // args.tensors
    params = [torch.nn.Parameter(torch.randn(size)) for _ in range(args.tensors)]
    for param in params:
        param.grad = torch.randn(size)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    times = []
    for step in range(args.steps + 2):
        start = time.perf_counter()
        optimizer.step()
        if step >= 2:  # the first steps allocate the moments
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    total = size * args.tensors
    print(f"fused AdamW, {total:,} fp32 parameters in {args.tensors} tensors, 1 thread, torch {torch.__version__}: "
          f"median {seconds * 1e3:.1f} ms a step (min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}), "
          f"{total * BYTES_PER_PARAM / seconds / 1e9:.1f} GB/s at {BYTES_PER_PARAM} bytes a parameter")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
