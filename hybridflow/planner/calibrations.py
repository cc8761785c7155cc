"""Calibrations shipped with hybridflow, loadable by name (``--calibration verl-published``).

``verl-published``: one set of constants fitted by ``benchmarks/published_runs.py --fit`` to the six
published verl runs of ``benchmarks/data/published_runs.json`` (H20, B200, H100; 8-128 GPUs),
shared by every device, with ``decode_mfu`` held at its prior (``fit.HELD``: those colocated runs cannot
identify it) and ``phase_overhead_s`` at 0 (``published_runs.PUBLISHED_HELD``: free, it stands in for what the
model misses on the short runs). There is no per-step constant: the step's other work is modelled
(``step_terms.py``). Refit and paste when the cost model changes; ``docs/benchmarks.md`` shows how far it leaves
each run.
"""

from __future__ import annotations

from typing import Any

BUILTIN: dict[str, dict[str, Any]] = {
    "verl-published": {
        "format": "hybridflow-calibration/1",
        "source": "benchmarks/published_runs.py --fit (six published verl runs, shared constants)",
        "held": ["decode_mfu", "phase_overhead_s"],
        "default": {
            "train_mfu": 0.75,
            "eff_half_tokens": 512.0,
            "hbm_efficiency": 0.3,
            "decode_mfu": 0.5,
            "prefill_mfu": 0.5,
            "host_efficiency": 0.5,
            "decode_step_overhead_s": 0.000265,
            "phase_overhead_s": 0.0,
            "micro_batch_overhead_s": 0.0,
            "moe_efficiency": 0.3186,
            "controller_gbs": 0.7585,
        },
        "devices": {},
    },
}
