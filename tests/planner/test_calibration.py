"""Calibration: fitting recovers known constants from synthetic measurements; files round-trip; errors name
the field; ``hybridflow calibrate`` writes a file that ``hybridflow plan --calibration`` loads."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hybridflow.cli import main
from hybridflow.planner.calibration import Calibration, Constants
from hybridflow.planner.fit import HELD, fit_calibration, fit_constants, loss
from hybridflow.planner.published import MeasuredCase, case_from_record

TRUTH = Constants(train_mfu=0.42, decode_mfu=0.3, hbm_efficiency=0.62, moe_efficiency=0.4,
                  decode_step_overhead_s=0.004, phase_overhead_s=3.0)
FITTED = ("train_mfu", "decode_mfu", "hbm_efficiency", "moe_efficiency", "decode_step_overhead_s",
          "phase_overhead_s")


def record(run_id: str, *, model: str, device: str, nodes: int, prompts: int, n: int, cap: int, mean: int,
           rollout_tp: int, reference: bool = False) -> dict[str, Any]:
    """A published-run record (the format of published_runs.json), timings to be filled in."""
    return {"id": run_id, "model": model, "params_b": 7, "gpus": {"type": device, "count": nodes * 8, "nodes": nodes,
                                                                   "gpus_per_node": 8},
            "batch_prompts": prompts, "n": n, "response_len_max": cap, "response_len_mean": mean,
            "rollout_tp": rollout_tp, "reference_model": reference, "critic": False, "reward_model": False,
            "train_backend": "FSDP", "grad_checkpointing": True, "rollout_gpu_memory_utilization": 0.6,
            "micro_batch": {"ppo_mini_batch_prompts": prompts // 4, "use_dynamic_bsz": True,
                            "actor_ppo_max_token_len_per_gpu": 16384, "log_prob_max_token_len_per_gpu": 32768},
            "timings_s": {"step": 1.0, "gen": 1.0, "old_log_prob": 1.0, "update_actor": 1.0},
            "hybridflow": {"prompt_len": 200}}


RECORDS = [
    record("dense-h100-short", model="Qwen2.5-7B", device="NVIDIA H100", nodes=1, prompts=256, n=4, cap=1024,
           mean=300, rollout_tp=1),
    record("dense-h20-long", model="Qwen2.5-Math-7B", device="NVIDIA H20", nodes=2, prompts=512, n=8, cap=8192,
           mean=2000, rollout_tp=2),
    record("moe-h20", model="Qwen3-30B-A3B", device="NVIDIA H20", nodes=4, prompts=256, n=8, cap=4096, mean=1200,
           rollout_tp=4, reference=True),
    record("few-long-b200", model="Qwen3-8B", device="NVIDIA B200", nodes=1, prompts=16, n=2, cap=16384,
           mean=4000, rollout_tp=8),
]


def synthetic_cases(truth: Constants) -> list[MeasuredCase]:
    """The records with their timings replaced by the model's own predictions under ``truth``."""
    cases = [case_from_record(item) for item in RECORDS]
    return [replace(case, measured=case.predict(Calibration(default=truth))) for case in cases]


def test_fit_recovers_known_constants_from_synthetic_measurements():
    cases = synthetic_cases(TRUTH)
    assert all(len(case.measured) == 4 or len(case.measured) == 5 for case in cases)
    pairs = [(case.predict, case.measured) for case in cases]
    assert loss(pairs, Calibration()) > 0.01  # the priors are off
    fitted = fit_constants(pairs, names=FITTED, restarts=4)
    assert loss(pairs, Calibration(default=fitted)) < 1e-6
    for name in FITTED:
        assert getattr(fitted, name) == pytest.approx(getattr(TRUTH, name), rel=0.05), name


def test_per_device_constants_apply_to_their_device_only():
    h20 = replace(TRUTH, train_mfu=0.6)
    calibration = Calibration(default=TRUTH).with_device("H20", h20)
    assert calibration.for_device("H20").train_mfu == 0.6 and calibration.for_device("H100-80G").train_mfu == 0.42
    cases = synthetic_cases(TRUTH)
    fitted = fit_calibration([(case.predict, case.measured) for case in cases], names=("train_mfu",),
                             start=replace(TRUTH, train_mfu=0.3), devices=[case.device for case in cases],
                             min_cases_per_device=2)
    assert fitted.default.train_mfu == pytest.approx(0.42, rel=0.02)
    assert [name for name, _ in fitted.devices] == ["H20"]


def test_held_constants_stay_at_their_start_and_are_recorded(tmp_path):
    # decode_mfu moved from its truth: fitting it would recover 0.3; holding it must leave the start's 0.45.
    cases = synthetic_cases(TRUTH)
    start = replace(TRUTH, decode_mfu=0.45, train_mfu=0.3)
    fitted = fit_calibration([(case.predict, case.measured) for case in cases], names=("train_mfu", "decode_mfu"),
                             held=("decode_mfu",), start=start)
    assert fitted.default.decode_mfu == 0.45 and fitted.held == ("decode_mfu",)
    assert fitted.default.train_mfu != 0.3  # the rest is still fitted
    path = tmp_path / "calibration.json"
    fitted.save(path)
    assert json.loads(path.read_text())["held"] == ["decode_mfu"]
    assert Calibration.load(path) == fitted
    with pytest.raises(ValueError, match=r"cannot hold unknown constants \['decode_mfu_typo'\]"):
        fit_calibration([(case.predict, case.measured) for case in cases], held=("decode_mfu_typo",))
    path.write_text(json.dumps({**fitted.to_dict(), "held": ["nope"]}))
    with pytest.raises(ValueError, match=r"held: \['nope'\] must be a list of constant names"):
        Calibration.load(path)


def test_the_shipped_calibration_holds_decode_mfu_and_the_phase_overhead_at_their_priors():
    shipped = Calibration.load("verl-published")
    assert HELD == ("decode_mfu",) and shipped.held == (*HELD, "phase_overhead_s")
    assert shipped.default.decode_mfu == Constants().decode_mfu
    assert shipped.default.phase_overhead_s == Constants().phase_overhead_s == 0.0


def test_calibration_files_round_trip_and_bad_ones_name_the_field(tmp_path):
    calibration = Calibration(default=TRUTH, source="test").with_device("H20", replace(TRUTH, train_mfu=0.6))
    path = tmp_path / "calibration.json"
    calibration.save(path)
    assert Calibration.load(path) == calibration
    data = json.loads(path.read_text())
    data["devices"]["H20"]["train_mfu"] = 1.7
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"devices.H20.*train_mfu=1.7 must be a fraction"):
        Calibration.load(path)
    data["devices"]["H20"] = {"train_mfu_typo": 0.5}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"unknown constants \['train_mfu_typo'\]"):
        Calibration.load(path)
    with pytest.raises(ValueError, match=r"Constants.phase_overhead_s=-1 must be >= 0"):
        Constants(phase_overhead_s=-1)
    data["devices"]["H20"] = {"step_overhead_s": 47.6}  # a calibration from before the step's terms were modelled
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"step_overhead_s is no longer a constant.*step_terms"):
        Calibration.load(path)
    with pytest.raises(ValueError, match=r"Constants.controller_gbs=0 must be > 0 GB/s"):
        Constants(controller_gbs=0)


def test_the_calibrate_command_writes_what_plan_loads(tmp_path, capsys):
    runs = tmp_path / "runs.json"
    records = []
    for case, item in zip(synthetic_cases(TRUTH), RECORDS, strict=True):
        records.append({**item, "timings_s": dict(case.measured)})
    runs.write_text(json.dumps(records))
    out = tmp_path / "calibration.json"
    assert main(["calibrate", "--published", str(runs), "--fit", "train_mfu,phase_overhead_s", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "before" in printed and "after" in printed
    assert "held at the priors (not fitted): decode_mfu=0.5" in printed
    assert Calibration.load(out).default.train_mfu != Constants().train_mfu
    code = main(["plan", "--cluster", "8xH20", "--model", "qwen2.5-7b", "--algorithm", "grpo", "--batch-size", "32",
                 "--calibration", str(out), "--json"])
    assert code == 0


def test_a_published_record_missing_a_field_is_named():
    with pytest.raises(ValueError, match=r"published run 'x': field 'batch_prompts' is missing"):
        case_from_record({"id": "x", "gpus": {"type": "H100", "count": 8, "nodes": 1, "gpus_per_node": 8},
                          "response_len_max": 512})
    with pytest.raises(ValueError, match=r"field 'gpus.nodes' is missing"):
        case_from_record({"id": "x", "gpus": {"type": "H100", "count": 8}, "batch_prompts": 8,
                          "response_len_max": 512})


def test_a_record_whose_update_takes_the_rollouts_log_probs_has_no_old_log_prob_pass():
    # verl's fully-async trainer (use_rollout_log_probs): the engine returns each sampled token's log-prob
    # and the update takes them as its old log-probs; the reference's pass stays.
    base = record("fa", model="Qwen2.5-7B", device="NVIDIA H20", nodes=1, prompts=64, n=4, cap=1024, mean=300,
                  rollout_tp=1, reference=True)
    recomputed = case_from_record(base)
    streamed = case_from_record({**base, "hybridflow": {**base["hybridflow"], "rollout_logprobs": True}})
    ops = {node.name: node.op.value for node in streamed.graph.nodes}
    assert "actor_logprob" in {node.name for node in recomputed.graph.nodes} and "actor_logprob" not in ops
    assert ops["actor_generate"] == "generate" and ops["reference_ref_logprob"] == "ref_logprob"
    update = next(node for node in streamed.graph.nodes if node.name == "actor_update")
    assert "rollout_logprobs" in update.inputs and "old_logprobs" not in update.inputs
    plan, before = streamed.plan(), recomputed.plan()
    assert "actor_logprob" not in {node.node for node in plan.nodes}
    assert plan.step_time_s < before.step_time_s  # one forward pass fewer
    with pytest.raises(ValueError, match="rollout_logprobs is for GRPO records"):
        case_from_record({**base, "critic": True, "hybridflow": {"rollout_logprobs": True}})


def test_the_shipped_calibration_meets_the_published_runs_targets_but_one():
    """Every published verl run (benchmarks/data/published_runs.json, with benchmarks/published_runs.py's stated
    assumptions): each step within 1.5x and each phase within 2x of the source's, one calibration for all. The
    ROCm blog's PPO run (verl 0.3 on vLLM 0.6.3) is the known miss: 0.46x before its V0 engine's serial CPU step,
    cache rebuild and every pass's memory-bound ops were priced, ~0.59x with them (docs/benchmarks.md)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        from published_runs import load_cases
    finally:
        sys.path.pop(0)
    shipped = Calibration.load("verl-published")
    for case in load_cases():
        predicted = case.predict(shipped)
        for key, seconds in case.measured.items():
            ratio = predicted[key] / seconds
            if case.id == "rocm_blog_verl_ppo_qwen2_7b_gsm8k_8xH100":
                assert 0.55 <= ratio <= 1.5, f"{case.id} {key}: {predicted[key]:.0f} s of {seconds:.0f} s"
                continue
            limit = 1.5 if key == "step" else 2.0
            assert 1 / limit <= ratio <= limit, f"{case.id} {key}: {predicted[key]:.0f} s of {seconds:.0f} s"
