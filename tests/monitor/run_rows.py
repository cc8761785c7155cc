"""A metrics.jsonl as ``hybridflow train`` writes it for a PPO run (actor + critic), built in the test."""

from __future__ import annotations

import json
import math
from pathlib import Path


def ppo_rows(steps: int = 30) -> list[dict[str, float]]:
    """Rows with the keys of hybridflow.train.metrics and the actor/critic losses, slowly improving."""
    rows = []
    for step in range(steps):
        t = step / max(steps - 1, 1)
        rows.append({
            "step": step, "reward/mean": 0.2 + 0.6 * t, "reward/std": 0.3 - 0.1 * t, "kl": 0.01 * t,
            "response_length/mean": 6.0 + 2 * math.sin(step), "response_length/max": 12.0,
            "actor/loss": -0.1 * t, "actor/pg_loss": -0.1 * t, "actor/clipfrac": 0.05, "actor/clipfrac_lower": 0.0,
            "actor/approx_kl": 0.001, "actor/kl_loss": 0.002 * t, "actor/entropy": 2.0 - t, "actor/grad_norm": 0.8,
            "actor/lr": 1e-4, "critic/loss": 0.5 - 0.3 * t, "critic/vf_loss": 0.5 - 0.3 * t,
            "critic/vf_clipfrac": 0.1, "critic/grad_norm": 1.5,
            "time/actor_generate": 0.4, "time/reward": 0.0004, "time/actor_update": 0.3, "time/step": 0.9,
            "throughput/tokens_per_s": 900.0, "throughput/actor_generate_tokens_per_s": 500.0,
            # A reward function "processes" tokens ~1000x faster than generation: needs a log axis.
            "throughput/reward_tokens_per_s": 5e5,
            "memory/rss_gb": 2.0 + 0.001 * (step % 3),  # near-constant: must not look like mountains
        })
    return rows


def write_run(run_dir: Path, rows: list[dict[str, float]]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run_dir
