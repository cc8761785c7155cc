"""Calibrations shipped with hybridflow, loadable by name (``--calibration verl-published``).

``verl-published``: one set of constants fitted by ``benchmarks/published_runs.py --fit`` to the six
published verl runs of ``../shared/calibration/published_runs.json`` (H20, B200, H100; 8-128 GPUs),
shared by every device. Refit and paste when the cost model changes; ``docs/benchmarks.md`` shows how
far it leaves each run.
"""

from __future__ import annotations

from typing import Any

BUILTIN: dict[str, dict[str, Any]] = {
    "verl-published": {
        "format": "hybridflow-calibration/1",
        "source": "benchmarks/published_runs.py --fit (six published verl runs, shared constants)",
        "default": {
            "train_mfu": 0.75,
            "eff_half_tokens": 512.0,
            "hbm_efficiency": 0.3,
            "decode_mfu": 0.267,
            "prefill_mfu": 0.5,
            "host_efficiency": 0.5,
            "decode_step_overhead_s": 0.0,
            "phase_overhead_s": 0.0,
            "step_overhead_s": 47.58,
            "moe_efficiency": 0.31,
            "controller_gbs": 0.8166,
        },
        "devices": {},
    },
}
