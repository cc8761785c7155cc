"""A vision-language policy under torchrun (issue 41): the rows' images reach the ranks of the other processes over
the torchrun control plane's safe wire, and the run samples, scores and trains as the local executor's run does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridflow.models.vision import build_tiny_vlm, save_vlm_dir, tiny_vlm_processor

ROOT = Path(__file__).resolve().parents[2]
METRICS = ("reward/mean", "response_length/mean", "actor/entropy", "actor/ref_kl")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "GROUP_RANK")


def _metrics(output: Path) -> list[float]:
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1]
    return [row[key] for row in rows for key in METRICS]


@pytest.mark.slow  # two runs: ~40 s each on 2 idle cores, 80 s beside other jobs
def test_a_torchrun_run_of_a_vlm_policy_samples_and_trains_as_a_local_one(tmp_path: Path) -> None:
    processor = tiny_vlm_processor()
    model = build_tiny_vlm(processor.tokenizer)
    torch.manual_seed(0)
    with torch.no_grad():  # wider weights than the default init, whose samples hardly vary with the image
        for param in model.parameters():
            if param.ndim > 1:
                param.normal_(0.0, 0.5)
    model_dir = save_vlm_dir(model, processor, tmp_path / "vlm")
    # An entropy bonus moves the actor even where a group's rewards tie, so step 1 reads the updated weights.
    common = ["--config", str(ROOT / "configs" / "grpo_vision.yaml"), f"model.path={model_dir}", "steps=2",
              "data.batch_size=4", "data.num_examples=16", "algorithm.options.n=4", "algorithm.options.kl_coef=0.01",
              "algorithm.options.entropy_coef=0.01", "placement.num_gpus=2", "logging.progress=false",
              "logging.plot=false"]
    env = {**{k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}, "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    script = str(ROOT / "examples" / "train_ppo.py")
    # `python -m torch.distributed.run` is torchrun, and works where the torchrun script is not installed
    runs = {"torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script,
                         *common, "executor.name=torchrun", f"output_dir={tmp_path / 'torchrun'}"],
            "local": [sys.executable, script, *common, "executor.name=local", f"output_dir={tmp_path / 'local'}"]}
    for name, command in runs.items():
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, (name, (done.stdout + done.stderr)[-3000:])
    workers = json.loads((tmp_path / "torchrun" / "torchrun_workers.json").read_text())
    assert [(w["rank"], sorted(w["roles"])) for w in workers] == [(0, ["actor", "reference"]),
                                                                 (1, ["actor", "reference"])]
    assert len({w["pid"] for w in workers}) == 2  # the second rank's rows (and images) crossed processes
    local = _metrics(tmp_path / "local")
    assert local[METRICS.index("actor/entropy")] > 0 and local[len(METRICS) + METRICS.index("actor/ref_kl")] > 0
    assert _metrics(tmp_path / "torchrun") == pytest.approx(local, abs=1e-5)
