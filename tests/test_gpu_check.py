"""benchmarks/gpu_check.py: its CPU mode end to end (what CI runs), the isolation of its parts, the plans its GPU mode
executes, and the packed-attention check on a CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # last: its names (packing...) shadow none
import gpu_check
import gpu_check_parts

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

GRPO_PHASES = {"actor_generate", "reward_score", "advantages", "reference_ref_logprob", "actor_update", "step"}


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("gpu_check")
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check_site.py"), str(site)], check=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)])}
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--cpu", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    return done.returncode, json.loads((out / "report.json").read_text()), out


@pytest.mark.slow
def test_cpu_mode_passes_every_part_that_runs_on_a_cpu_and_skips_the_rest_with_a_reason(cpu_report: Any) -> None:
    code, report, out = cpu_report
    rows = {row["name"]: row for row in report["parts"]}
    assert code == 0 and report["passed"] and report["mode"] == "cpu"
    assert list(rows) == ["model", *(part.name for part in gpu_check_parts.PARTS)]
    skipped = {name for name, row in rows.items() if row["status"] == "skipped"}
    assert skipped == {"attention", "fsdp2-offload", "deepspeed-zero2", "deepspeed-zero3"}
    assert "CUDA" in rows["attention"]["reason"] and "accelerator" in rows["fsdp2-offload"]["reason"]
    assert all(rows[name]["status"] == "pass" for name in set(rows) - skipped)
    for name in set(rows) - skipped:
        assert 0 < rows[name]["seconds"] <= rows[name]["limit_s"] and (out / rows[name]["log"]).is_file()
    assert report["environment"]["hybridflow"] == str(ROOT / "hybridflow")  # the checkout, through the site folder


@pytest.mark.slow
def test_each_grpo_part_puts_the_planners_predictions_beside_what_it_measured(cpu_report: Any) -> None:
    _, report, out = cpu_report
    rows = {row["name"]: row["result"] for row in report["parts"] if row["status"] == "pass" and row["name"] != "model"}
    assert set(rows) == {"torch", "torch-checkpointing", "fsdp2", "lora"}
    for name, result in rows.items():
        assert set(result["phases"]) == GRPO_PHASES, name
        for phase in result["phases"].values():
            assert phase["measured_s"] > 0 and phase["predicted_s"] > 0
            assert phase["ratio"] == pytest.approx(phase["predicted_s"] / phase["measured_s"])
        assert result["memory"]["predicted_bytes"] > 0 and result["memory"]["measured_bytes"] is None  # no CUDA
        assert result["executed"] and not result["problems"] and result["steps"] == 3
    assert rows["torch-checkpointing"]["layouts"]["actor"]["gradient_checkpointing"]
    assert not rows["torch"]["layouts"]["actor"]["gradient_checkpointing"]
    assert rows["fsdp2"]["executed"][0]["layouts"]["actor"]["sharding"] == "FULL_SHARD"
    assert rows["lora"]["layouts"]["reference"]["shares_weights_with"] == "actor"
    markdown = (out / "report.md").read_text()
    assert "| torch-checkpointing | pass |" in markdown and "### fsdp2:" in markdown
    assert "| deepspeed-zero3 | skipped: CPU mode: DeepSpeed" in markdown


def test_a_part_that_hangs_or_crashes_fails_alone_and_its_children_are_killed(tmp_path: Path) -> None:
    child = tmp_path / "child.pid"
    hang = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            f"time.sleep(60)']); open({str(child)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    started = time.perf_counter()
    hung = gpu_check.run_part([sys.executable, "-c", hang], limit=3, log=tmp_path / "hang.log")
    assert hung["status"] == "fail" and hung["reason"] == "timed out after 3 s"
    assert time.perf_counter() - started < 20
    assert _gone_within(int(child.read_text()), seconds=10)  # the part's own child went with it
    crashed = gpu_check.run_part([sys.executable, "-c", "raise ValueError('the kernel refused')"], limit=30,
                                 log=tmp_path / "crash.log")
    assert crashed["status"] == "fail" and crashed["reason"] == "exit code 1: ValueError: the kernel refused"
    done = gpu_check.run_part([sys.executable, "-c", "print('ok')"], limit=30, log=tmp_path / "ok.log")
    assert done["status"] == "pass" and (tmp_path / "ok.log").read_text() == "ok\n"


def _gone_within(pid: int, *, seconds: float) -> bool:
    """Whether ``pid`` stops running within ``seconds``. SIGKILL is delivered asynchronously: on a loaded machine the
    orphaned grandchild can still be scheduled for a moment after ``killpg`` returns (CI saw it once), and a killed
    process whose parent has gone may linger as a zombie until init reaps it."""
    import psutil

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_parts_without_their_packages_or_a_gpu_are_skipped_with_the_reason() -> None:
    offload = gpu_check_parts.part_named("fsdp2-offload")
    assert gpu_check.skip_reason(offload, "cuda", named=False) is None
    assert "CPUOffloadPolicy" in gpu_check.skip_reason(offload, "cpu", named=True)
    missing = gpu_check_parts.Part(name="x", summary="", needs=("no_such_module_here",))
    assert gpu_check.skip_reason(missing, "cuda", named=False).startswith("no_such_module_here is not installed")
    zero3 = gpu_check_parts.part_named("deepspeed-zero3")
    if gpu_check.skip_reason(zero3, "cuda", named=False) is None:  # deepspeed installed: CPU mode runs it if named
        assert gpu_check.skip_reason(zero3, "cpu", named=True) is None
        assert "--parts" in gpu_check.skip_reason(zero3, "cpu", named=False)


def _real_shape_dir(folder: Path) -> Path:
    """Qwen2.5-0.5B's config.json and the tokenizer, no weights: all the planner reads."""
    from gpu_calibrate import hf_config

    from hybridflow.data import char_tokenizer
    from hybridflow.planner import ModelSpec

    config = {**hf_config(ModelSpec.preset("qwen2.5-0.5b")), "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    char_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("part", [p for p in gpu_check_parts.PARTS if p.name != "attention"], ids=lambda p: p.name)
def test_gpu_mode_plans_the_real_shape_in_bf16_with_exactly_the_parts_layout(part: Any, tmp_path: Path) -> None:
    from gpu_check_grpo import plan_part

    from hybridflow.train import setup

    if gpu_check.skip_reason(part, "cuda", named=False):
        pytest.skip(gpu_check.skip_reason(part, "cuda", named=False))
    planned = plan_part(part, _real_shape_dir(tmp_path / "model"), tmp_path / "run", gpu_check_parts.WORKLOADS["cuda"],
                        gpu_check_parts.LORA, cluster="1xH100-80G", dtype="bf16")
    assert planned.plan.feasible, planned.plan.problems  # 0.5B with its reference fits an 80 GB GPU
    layouts = {layout.role: layout for group in planned.plan.groups for layout in group.layouts}
    actor = layouts["actor"]
    assert (actor.dtype, actor.sharding, actor.gradient_checkpointing, actor.padding) == (
        "bf16", part.sharding, part.checkpointing, False)
    assert actor.offloaded == frozenset(part.offload)
    assert (layouts["reference"].shares_weights_with == "actor") == part.lora
    assert planned.plan.groups[0].memory_per_gpu_bytes > 2 * 494e6  # bf16 weights of the policy at least
    setup.check_given_plan(planned.config, planned.graph, planned.plan)  # the backends run it as planned


def test_the_packed_attention_check_runs_on_a_cpu(tmp_path: Path) -> None:
    gpu_check_parts.build_model("cpu", tmp_path / "model")
    result = gpu_check_parts.check_attention(tmp_path / "model", device="cpu")
    assert result["attention_implementation"] == "hybridflow_sdpa_varlen"
    assert result["tokens"] == 136 and result["mean_gap"] < gpu_check_parts.ATTENTION_GAP
