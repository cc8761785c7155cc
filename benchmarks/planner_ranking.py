"""Does the calibrated cost model rank placements like real runs? CPU, two logical GPUs, Ray.

Workload **B** (ranked): PPO with a critic, a reference and a reward *model* (four networks: policy and
reference ``tiny-qwen2-wide``, critic and reward model ``tiny-qwen2``, a quarter of the FLOPs, so that no two
roles cost the same; 128 prompts, 32 new tokens, 2 epochs x 2 mini-batches) in every placement on two
logical CPU GPUs up to
swapping them: the actor on GPU 0, each other role on GPU 0 or 1 (8 placements), plus everything on both
(data parallel): 9 placements whose modelled steps differ by up to ~2x. Workload **A** (calibration): GRPO
with a reward model on a smaller network (``tiny-qwen2``, 32 prompts x 4 samples, 16 new tokens) in its 5
placements. The constants are fitted on A's runs (``hybridflow calibrate``'s code path: plan.json +
metrics.jsonl), then B's placements are predicted with them and ranked against B's measured step times
(Kendall tau).

How the measurement is made meaningful on a shared 2-core machine: one worker process per logical GPU and
core (``OMP_NUM_THREADS=1``, Ray executor), steps of seconds (not tenths), ``--repeats`` runs of each B
placement interleaved across placements (so a load change hits every placement alike), the median of
every kept step over the repeats, and Ray's workers at the driver's priority (Ray starts them 15 nice
levels lower, below every other process of a shared machine). On a machine other jobs load, run it with a
raised priority (``nice -n -10``, as root) and note the load average it prints. The CPU device of the
catalogue is one core (``docs/planner.md``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/planner_ranking.py [--steps 6] [--repeats 2] [--out DIR]

Each run takes ~20-45 s (Ray start-up included); the whole benchmark ~15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from hybridflow.graph import Workload, load_graph
from hybridflow.planner import Cluster, ModelSpec
from hybridflow.planner.calibration import Calibration
from hybridflow.planner.fit import describe, fit_calibration
from hybridflow.planner.measured import case_from_run
from hybridflow.planner.published import MeasuredCase
from hybridflow.planner.settings import RunSettings

SKIP_STEPS = 2  # warm-up steps left out of every run (first-step allocations, Ray actor start)
FITTED = ("train_mfu", "eff_half_tokens", "decode_step_overhead_s", "phase_overhead_s", "micro_batch_overhead_s")


def placements(roles: tuple[str, ...]) -> dict[str, dict[str, list[int]]]:
    """Every placement of ``roles`` on two logical GPUs up to swapping them (the first role on GPU 0, each
    other on 0 or 1), and all of them on both (colocated roles list the same GPUs, so a group on both
    GPUs holds every role)."""
    first, rest = roles[0], roles[1:]
    chosen: dict[str, dict[str, list[int]]] = {}
    for gpus in itertools.product((0, 1), repeat=len(rest)):
        meshes = {first: [0], **{role: [gpu] for role, gpu in zip(rest, gpus, strict=True)}}
        on = [",".join(r for r in roles if meshes[r] == [g]) for g in (0, 1)]
        chosen[" | ".join(f"{names}@{g}" for g, names in enumerate(on) if names)] = meshes
    chosen["all@0-1"] = {role: [0, 1] for role in roles}
    return chosen


WORKLOADS: dict[str, dict[str, Any]] = {
    "A": {"algorithm": "grpo", "options": {"n": 4, "kl_coef": 0.04, "max_new_tokens": 16}, "model": "tiny-qwen2",
          "batch_size": 32, "roles": ("actor", "reference", "reward")},
    "B": {"algorithm": "ppo", "options": {"kl_coef": 0.05, "max_new_tokens": 32}, "model": "tiny-qwen2-wide",
          "batch_size": 128, "roles": ("actor", "critic", "reference", "reward"), "small": ("critic", "reward")},
}
SMALL = "tiny-qwen2"  # the network of B's "small" roles: a quarter of the wide policy's FLOPs, so no two roles tie
EPOCHS, MINI_BATCHES = 2, 2


def small_model(root: Path) -> Path:
    """A randomly initialised ``SMALL`` network with the tasks' character tokenizer (the policy's vocabulary)."""
    target = root / SMALL
    if not (target / "config.json").is_file():
        from hybridflow.models import build_tiny_causal_lm, save_model_dir
        from hybridflow.train import setup
        from hybridflow.train.config import TrainConfig

        tokenizer = setup.policy_tokenizer(TrainConfig())
        save_model_dir(build_tiny_causal_lm(SMALL, vocab_size=len(tokenizer), seed=1), tokenizer, target)
    return target.resolve()


def config(workload: dict[str, Any], meshes: dict[str, list[int]], steps: int, out: Path) -> dict[str, Any]:
    optim = {"grad_clip": 1.0, "micro_batch_size": 64, "epochs": EPOCHS, "mini_batches": MINI_BATCHES}
    small = {role: {"model": str(small_model(out.parent))} for role in workload.get("small", ())}
    return {"roles": small, "algorithm": workload["algorithm"], "seed": 0, "steps": steps, "executor.name": "ray",
            "placement.num_gpus": 2, "algorithm.options": {**workload["options"], "reward_kind": "reward_model"},
            "placement.mode": "manual", "placement.meshes": meshes, "model": {"name": workload["model"],
                                                                              "sft_steps": 0},
            "data": {"task": "reverse", "num_examples": 2000, "batch_size": workload["batch_size"]},
            "optim": {"actor": {"lr": 5e-4, **optim}, "critic": {"lr": 3e-3, **optim}}, "output_dir": str(out),
            "logging.trackers": [], "logging.plot": False, "logging.progress": False}


def slug(name: str) -> str:
    return name.replace(" | ", "_").replace("@", "-at-").replace(",", "+")


def run(workload: str, name: str, meshes: dict[str, list[int]], repeat: int, steps: int, root: Path) -> Path:
    out = root / f"{workload}-{slug(name)}-r{repeat}"
    return train_at_driver_priority(config(WORKLOADS[workload], meshes, steps, out), out)


def train_at_driver_priority(settings: dict[str, Any], out: Path) -> Path:
    """``hybridflow train`` on ``settings`` (whose ``output_dir`` is ``out``) in a process of its own, its config
    saved beside the run as ``out.json``; a finished run (a metrics row for every step) is reused, one killed
    part way is run again.

    Ray starts its workers 15 nice levels below the driver: on a shared machine every other process then
    preempts the logical GPUs. The benchmarks measure workers at the driver's priority.
    """
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and len(metrics.read_text().splitlines()) >= settings["steps"]:
        return out
    if out.exists():
        shutil.rmtree(out)  # hybridflow train refuses a non-empty output_dir it would not resume
    path = out.parent / f"{out.name}.json"
    path.write_text(json.dumps(settings))  # JSON is YAML
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_worker_niceness": "0"}
    subprocess.run([sys.executable, "-m", "hybridflow.cli", "train", "--config", str(path)], check=True,
                   stdout=subprocess.DEVNULL, timeout=900, env=env)
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
    spec = WORKLOADS[workload]
    graph = load_graph(spec["algorithm"], **spec["options"], reward_kind="reward_model")
    model = ModelSpec.from_hf_config(folder / "init_model")
    models = {role: ModelSpec.from_hf_config(small_model(folder.parent)) if role in spec.get("small", ()) else model
              for role in spec["roles"]}
    load = Workload(batch_size=spec["batch_size"], prompt_len=prompt, response_len=spec["options"]["max_new_tokens"],
                    n_samples=spec["options"].get("n", 1))
    rows = load.sequences(graph)
    settings = RunSettings(epochs=EPOCHS, mini_batch_size=rows // MINI_BATCHES)
    return case_from_run(folder, graph=graph, models=models, workload=load,
                         cluster=Cluster.parse("2xCPU"), settings=settings, skip_steps=SKIP_STEPS)


def kept_steps(folder: Path) -> list[float]:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [float(r["time/step"]) for r in records if "time/step" in r][SKIP_STEPS:]


def median_case(folders: list[Path], workload: str, prompt: int) -> MeasuredCase:
    """The first repeat's case with every measured key replaced by its median over the repeats' kept steps."""
    cases = [case(folder, workload, prompt) for folder in folders]
    keys = set.intersection(*(set(c.measured) for c in cases))
    measured = {key: statistics.median(c.measured[key] for c in cases) for key in keys}
    measured["step"] = statistics.median(step for folder in folders for step in kept_steps(folder))
    return replace(cases[0], measured=measured)


def _concordance(xs: list[float], ys: list[float]) -> tuple[int, int, int, int]:
    """(concordant - discordant pairs, all pairs, pairs xs does not tie, pairs ys does not tie)."""
    pairs = list(itertools.combinations(range(len(xs)), 2))
    signs = [(xs[i] - xs[j]) * (ys[i] - ys[j]) for i, j in pairs]
    score = sum(sign > 0 for sign in signs) - sum(sign < 0 for sign in signs)
    return score, len(pairs), sum(xs[i] != xs[j] for i, j in pairs), sum(ys[i] != ys[j] for i, j in pairs)


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-a: (concordant - discordant pairs) / all pairs; a pair tied in either list scores 0."""
    score, pairs, _, _ = _concordance(xs, ys)
    return score / pairs


def kendall_tau_b(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-b (scipy.stats.kendalltau's default): tau-a's numerator over sqrt((n0 - ties in xs)(n0 - ties
    in ys)), so a pair one list ties (two runs the planner costs the same) leaves the score's range instead of
    counting against it."""
    score, _, untied_x, untied_y = _concordance(xs, ys)
    return score / math.sqrt(untied_x * untied_y) if untied_x and untied_y else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each workload-B placement, interleaved")
    parser.add_argument("--out", type=Path, default=Path("runs/planner_ranking"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    folders: dict[tuple[str, str], list[Path]] = {}
    for workload, repeats in (("A", 1), ("B", args.repeats)):
        chosen = placements(WORKLOADS[workload]["roles"])
        for repeat in range(repeats):  # interleaved: every placement once before any placement twice
            for name, meshes in chosen.items():
                print(f"{workload} {name} (repeat {repeat}); load average {os.getloadavg()[0]:.1f}", flush=True)
                folders.setdefault((workload, name), []).append(run(workload, name, meshes, repeat, args.steps,
                                                                    args.out))
    prompts = {w: prompt_tokens(next(args.out.glob(f"{w}-*.json"))) for w in WORKLOADS}
    cases = {key: median_case(paths, key[0], prompts[key[0]]) for key, paths in folders.items()}
    train = [(c.predict, c.measured) for (w, _), c in cases.items() if w == "A"]
    fitted = fit_calibration(train, names=FITTED, source="benchmarks/planner_ranking.py (workload A)")
    print(f"fitted on workload A: {describe(fitted.default, FITTED)}")
    names = [name for w, name in cases if w == "B"]
    measured = [cases[("B", name)].measured["step"] for name in names]
    priors = [cases[("B", name)].predict(Calibration())["step"] for name in names]
    predicted = [cases[("B", name)].predict(fitted)["step"] for name in names]
    print("| placement (B) | measured step, median (s) | predicted, priors (s) | predicted, calibrated on A (s) |")
    print("|---|---|---|---|")
    for name, step, prior, after in zip(names, measured, priors, predicted, strict=True):
        print(f"| {name} | {step:.2f} | {prior:.2f} | {after:.2f} |")
    print(f"Kendall tau, calibrated on A: {kendall_tau(predicted, measured):.2f}; priors: "
          f"{kendall_tau(priors, measured):.2f} (target >= 0.8); measured steps {min(measured):.2f}-"
          f"{max(measured):.2f} s; load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
