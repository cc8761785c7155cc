"""How far an update's gradient moves when its mini batch is cut differently: micro batch sizes 1, 2, 4, all and
1 or 2 data-parallel ranks, on the torch, FSDP and DeepSpeed backends, for every loss aggregation mode.

    .venv/bin/python benchmarks/loss_invariance.py

Each cell is the largest gradient difference to one pass over the whole mini batch (torch, one rank),
relative to the largest gradient (DeepSpeed: the global gradient norm's relative difference). The
mini batch has ragged responses (1 to 5 tokens) and one fully masked row. Prints a markdown table.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "backends"))
from harness import run_ranks
from norm_ranks import MODES, gradient_gaps


def main() -> None:
    results = {backend: run_ranks(gradient_gaps, backend) for backend in ("torch", "fsdp", "deepspeed")}
    print("| mode | backend | cut (dp / micro batch size) | max relative gap | row-weighted (old) |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        for backend, ranks in results.items():
            cuts = sorted(ranks[0][mode]["gaps"])
            worst = {cut: max(rank[mode]["gaps"][cut] for rank in ranks) for cut in cuts}
            legacy = ranks[0].get(f"{mode}/legacy_gap")
            old = f"{legacy:.1e}" if legacy is not None else "-"
            print(f"| {mode} | {backend} | {', '.join(cuts)} | {max(worst.values()):.1e} | {old} |")


if __name__ == "__main__":
    main()
