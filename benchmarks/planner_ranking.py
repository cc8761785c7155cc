"""Does the calibrated cost model rank placements like real runs? CPU, logical GPUs, Ray.

Eight placements of PPO (tiny Qwen2, string reversal) on two logical CPU GPUs are run for a few steps
with ``hybridflow train`` (executor ray, placement manual) for two workloads. The constants are fitted on
workload A's runs (``hybridflow calibrate``'s code path: plan.json + metrics.jsonl); then workload B's
placements are predicted with them and ranked against B's measured step times (Kendall tau).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/planner_ranking.py [--steps 8] [--out DIR]

Each run takes ~30-60 s (Ray start-up included); the whole benchmark 10-20 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from hybridflow.graph import Workload, load_graph
from hybridflow.planner import Cluster, ModelSpec
from hybridflow.planner.calibration import Calibration
from hybridflow.planner.fit import describe, fit_calibration
from hybridflow.planner.measured import case_from_run
from hybridflow.planner.published import MeasuredCase
from hybridflow.planner.settings import RunSettings

PLACEMENTS: dict[str, dict[str, list[int]]] = {
    "all@0": {"actor": [0], "reference": [0], "critic": [0]},
    "all@0-1": {"actor": [0, 1], "reference": [0, 1], "critic": [0, 1]},
    "actor+ref@0,critic@1": {"actor": [0], "reference": [0], "critic": [1]},
    "actor+critic@0,ref@1": {"actor": [0], "reference": [1], "critic": [0]},
    "actor@0,ref+critic@1": {"actor": [0], "reference": [1], "critic": [1]},
    "all@0,rollout@1": {"actor": [0], "reference": [0], "critic": [0], "actor:rollout": [1]},
    "actor+critic@0,ref+rollout@1": {"actor": [0], "reference": [1], "critic": [0], "actor:rollout": [1]},
    "actor+ref@0,critic+rollout@1": {"actor": [0], "reference": [0], "critic": [1], "actor:rollout": [1]},
}
WORKLOADS = {"A": {"batch_size": 64, "max_new_tokens": 8}, "B": {"batch_size": 128, "max_new_tokens": 16}}
EPOCHS, MINI_BATCHES = 2, 2
FITTED = ("train_mfu", "decode_step_overhead_s", "phase_overhead_s", "micro_batch_overhead_s", "step_overhead_s")


def config(workload: dict[str, int], meshes: dict[str, list[int]], steps: int, out: Path) -> dict[str, Any]:
    optim = {"grad_clip": 1.0, "micro_batch_size": 128, "epochs": EPOCHS, "mini_batches": MINI_BATCHES}
    return {"algorithm": "ppo", "seed": 0, "steps": steps, "executor": "ray", "num_gpus": 2,
            "algorithm_options": {"kl_coef": 0.0, "max_new_tokens": workload["max_new_tokens"]},
            "placement": "manual", "meshes": meshes, "model": {"name": "tiny-qwen2", "sft_steps": 0},
            "data": {"task": "reverse", "num_examples": 2000, "batch_size": workload["batch_size"]},
            "actor": {"lr": 5e-4, **optim}, "critic": {"lr": 3e-3, **optim}, "output_dir": str(out),
            "trackers": [], "tensorboard": False, "plot": False, "progress": False}


def run(name: str, workload: str, steps: int, root: Path) -> Path:
    out = root / f"{workload}-{name.replace('@', '_at_').replace(',', '_').replace('+', '-')}"
    if (out / "metrics.jsonl").is_file():
        return out  # reuse a finished run
    path = root / f"{out.name}.json"
    path.write_text(json.dumps(config(WORKLOADS[workload], PLACEMENTS[name], steps, out)))  # JSON is YAML
    subprocess.run([sys.executable, "-m", "hybridflow.cli", "train", "--config", str(path)], check=True,
                   stdout=subprocess.DEVNULL, timeout=600)
    return out


def prompt_tokens(config_path: Path) -> int:
    """The longest prompt in tokens, as the trainer measured it for its own plan."""
    from hybridflow.train import setup
    from hybridflow.train.config import load_config

    config = load_config(config_path)
    train, _ = setup.prepare_data(config, setup.data_splits(config), setup.policy_tokenizer(config))
    return int(train.longest_prompt_tokens)


def case(folder: Path, workload: str, prompt: int) -> MeasuredCase:
    """A finished run re-costed with the trainer's planner inputs (the model as saved, its real vocabulary)."""
    graph = load_graph("ppo", kl_coef=0.0, max_new_tokens=WORKLOADS[workload]["max_new_tokens"],
                       reward_kind="reward_function")
    spec = ModelSpec.from_hf_config(folder / "init_model")
    models = {role: spec for role in ("actor", "reference", "critic")}
    rows = WORKLOADS[workload]["batch_size"]
    load = Workload(batch_size=rows, prompt_len=prompt, response_len=WORKLOADS[workload]["max_new_tokens"])
    settings = RunSettings(epochs=EPOCHS, mini_batch_size=rows // MINI_BATCHES)
    return case_from_run(folder, graph=graph, models=models, workload=load, cluster=Cluster.parse("2xCPU"),
                         settings=settings, skip_steps=2)


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    pairs = list(itertools.combinations(range(len(xs)), 2))
    score = sum((xs[i] - xs[j]) * (ys[i] - ys[j]) > 0 for i, j in pairs)
    score -= sum((xs[i] - xs[j]) * (ys[i] - ys[j]) < 0 for i, j in pairs)
    return score / len(pairs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("runs/planner_ranking"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {(w, name): run(name, w, args.steps, args.out) for w in WORKLOADS for name in PLACEMENTS}
    prompt = prompt_tokens(next(iter(args.out.glob("A-*.json"))))
    cases = {key: case(folder, key[0], prompt) for key, folder in runs.items()}
    train = [(c.predict, c.measured) for (w, _), c in cases.items() if w == "A"]
    fitted = fit_calibration(train, names=FITTED, source="benchmarks/planner_ranking.py (workload A)")
    print(f"fitted on workload A: {describe(fitted.default, FITTED)}")
    measured, predicted = [], []
    print("| placement | B measured step (s) | B predicted, priors (s) | B predicted, calibrated on A (s) |")
    print("|---|---|---|---|")
    for name in PLACEMENTS:
        c = cases[("B", name)]
        step, prior, after = c.measured["step"], c.predict(Calibration())["step"], c.predict(fitted)["step"]
        measured.append(step)
        predicted.append(after)
        print(f"| {name} | {step:.3f} | {prior:.3f} | {after:.3f} |")
    priors = [cases[("B", name)].predict(Calibration())["step"] for name in PLACEMENTS]
    print(f"Kendall tau, calibrated: {kendall_tau(predicted, measured):.2f}; priors: "
          f"{kendall_tau(priors, measured):.2f} (target >= 0.8); spread of measured steps "
          f"{statistics.pstdev(measured) / statistics.mean(measured):.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
