"""Tensor parallelism in the FSDP backend against the unsharded torch engine: tp=2 on two gloo ranks (the suite's
check) and dp=2 x tp=2 (FSDP2 x TP on a 2-D mesh) on four, which is too slow for the suite on two cores.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tensor_parallel.py [--worlds 2 4]

Each row is the worst rank's gap: log-probs (packed and padded rows), critic values and reward scores, a clipped PPO
update's gradients (relative to the largest) and the updated weights, the whole weights a rollout receives, greedy
tokens, a DCP round trip, and the parameter bytes each rank holds. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "backends"))
from harness import run_ranks
from tp_ranks import tp_checks

GAPS = ("logprobs_packed", "logprobs_padded", "entropy_packed", "values", "scores", "grad_gap", "weight_gap",
        "stream_gap", "restore_gap")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="ranks per run (tp=2 in each)")
    args = parser.parse_args()
    print("| ranks | dp x tp | " + " | ".join(GAPS) + " | greedy equal | param bytes per rank | seconds |")
    print("|---|---|" + "---|" * (len(GAPS) + 3))
    for world in args.worlds:
        start = time.perf_counter()
        ranks = run_ranks(tp_checks, 2, world_size=world)
        seconds = time.perf_counter() - start
        worst = {name: max(rank[name] for rank in ranks) for name in GAPS}
        greedy = all(rank["greedy_equal"] for rank in ranks)
        local = max(rank["local_param_bytes"] for rank in ranks)
        print(f"| {world} | {world // 2} x 2 | " + " | ".join(f"{worst[name]:.1e}" for name in GAPS)
              + f" | {greedy} | {local:,} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
