"""The planner's cost model against six published verl runs (benchmarks/data/published_runs.json).

Every run is entered as it ran (its mapping: everything colocated; its layouts, lengths, offload and
batching), costed with the priors and with one calibration shared by all runs, and compared with the
published step and per-phase seconds. Nobody on this project measured these runs: the timings are the
sources' own. What the sources leave out is assumed below, once per run, with the reason.

    .venv/bin/python benchmarks/published_runs.py [--runs PATH] [--fit] [--per-device] [--write-calibration FILE]
        [--markdown] [--export-records FILE] [--companions]

``--fit`` fits the calibration on these runs (``hybridflow calibrate --published PATH --hold
decode_mfu,phase_overhead_s`` fits the same way from the records alone), with ``PUBLISHED_HELD`` held at its
priors: ``decode_mfu`` (``fit.HELD``: these colocated runs cannot tell it apart from the drain to the longest
response, ``docs/planner.md``, "Calibration") and ``phase_overhead_s`` (left free, it becomes a per-call constant
standing in for what the model misses on the short runs: 3.3 s a phase, ``docs/benchmarks.md``); without
it the script uses the shipped ``verl-published`` calibration (``hybridflow/planner/calibrations.py``,
pasted from ``--fit --write-calibration``).

Assumptions shared by every run (also in ``hybridflow.planner.published.DEFAULTS``):
- Everything is colocated on all GPUs (each source says so) and the reward is a rule on the driver.
- Response lengths follow a lognormal with the stated mean whose 99.9th percentile is the cap; packed
  sequences (remove-padding) for forward and update passes; the sync rollout waits for the longest.
- verl's ``gen`` phase holds the engine's wake/sleep and the weight resharding; ``step`` is the sum of the
  phases, run one after another (verl's synchronous trainer; ``overlays.ControllerOverlay``), the driver's
  rule-based reward among them (detokenise and score each sample, serially), plus what its step timer holds
  on average beyond the graph: validation every ``test_freq`` steps and checkpoint writes every ``save_freq``
  steps, as each run's script sets them (``ASSUMPTIONS``; ``hybridflow.planner.step_terms``). Data loading and
  logging fall outside verl's step timer. There is no fitted per-step constant.
- The rollout decodes eagerly (no CUDA graphs) where verl's default did (``enforce_eager: True`` through 0.5) and
  the record does not say otherwise (``published.VERL_EAGER_UNTIL``).
- A record whose engine note names a vLLM release before 0.7 ran verl's vendored V0 engine
  (``published.VLLM_VENDORED_BEFORE``; the ROCm blog's "0.6.3-era"): eager, its per-step CPU work is serial, and it
  rebuilds its cache for every rollout (``Framework.vllm_v0_engine``).
- The engine sleeps between rollouts (``free_cache_engine``); verl's default gpu_memory_utilization is
  0.5 when a run does not give one.
- Megatron runs shard optimizer states over data-parallel ranks (distributed optimizer: ZeRO-1); context
  parallelism is costed as Ulysses sequence parallelism (the same all-to-all volume, to first order).
- verl's trainer ships every worker call's whole batch through its single controller and back (DataProto
  through the Ray object store), padded to the prompt and response caps (``prompt_len_max``,
  ``response_len_max``): the verl overlay every verl record gets (``overlays.ControllerOverlay``, with
  ``RunSettings.max_prompt_len``), at the calibrated ``controller_gbs``. Every run here is verl's, so every run
  pays it; it matters at the 28K cap (10 GB a call). hybridflow's own plans never carry it.

``--companions`` costs each record's ``companion_split_run`` (the same experiment on split pools, run
asynchronously) in its own mode on its published split with its own script's settings, beside the colocated
arm costed ``sync`` and ``hybridflow plan --pipeline auto``'s choice: it prints ``benchmarks/published_pairs.py``
(``PAIRS`` there states each split arm's settings and sources). The one-step-off arm is costed
``one_step_off``, verl's fully-async arms ``async`` with staleness 1 (``docs/planner.md``, "Asynchronous mode"),
their update taking the rollout's log-probs as verl's ``use_rollout_log_probs`` does (no old_log_prob pass).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from hybridflow.planner.calibration import Calibration
from hybridflow.planner.fit import FITTED, HELD, fit_calibration
from hybridflow.planner.published import MeasuredCase, case_from_record

# Held at their priors when fitting on these runs (module docstring).
PUBLISHED_HELD = (*HELD, "phase_overhead_s")

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks" / "data" / "published_runs.json"
# Runs that are only ever held out (never in --fit): costed by --held-out beside the HELD_OUT arms below.
HELD_OUT_RUNS = ROOT / "benchmarks" / "data" / "held_out_runs.json"

MATH_PROMPT = 200  # DAPO-Math-17k prompts with the DAPO instruction template: ~150-250 tokens
GSM8K_PROMPT = 130  # GSM8K question with verl's "Let's think step by step ... ####" template
# Mean response lengths nobody published; our guesses, uncertain by +-50%. Disclosure: the 8K-cap DAPO and the
# 30B guesses were chosen after looking at those runs' published old_log_prob times (which, at a plausible MFU,
# imply the tokens per step), so the forward/update phases of those runs are not independent checks.
DAPO_7B_MEAN = 1500  # Qwen2.5-Math-7B on DAPO-Math-17k, averaged over a run
# The 28K-cap run is the same model, data and recipe, so it gets the same mean: a cap far above the answers
# does not lengthen them (the authors raised it to expose the long tail), and the run's own total times show
# its lengths did not grow over training: 10h22m per 100 steps in each of its four 100-step windows
# (10h22m, 20h45m, 1d7h6m, 1d17h32m), so its 400-step mean is its early mean. (The previous guess, 3,500 "as
# the cap allows", had been read off its old_log_prob time.)
DAPO_7B_LONG_MEAN = DAPO_7B_MEAN
DAPO_30B_MEAN = 2500  # Qwen3-30B-A3B-Base, 8K cap, 400 steps: a stronger base reasons longer; the cap binds
GSM8K_MEAN = 250  # a 7B instruct model's GSM8K chain of thought
AIME_2024 = 30  # validation prompts of the DAPO recipes' aime-2024.parquet (AIME 2024 I and II; val_kwargs.n=1)
GSM8K_TEST = 1319  # GSM8K's test split, verl's gsm8k preprocessing (val_kwargs.n defaults to 1, greedy)
# What each published step averages over beyond its graph (hybridflow.planner.step_terms): verl's step timer holds
# its validation (every test_freq steps) and checkpoint writes (every save_freq steps, and at the last step when
# save_freq > 0), so a run average holds 1/test_freq validations and 1/save_freq checkpoints per step.
EVERY_10TH_VALIDATES_ON_AIME = {"validations_per_step": 0.1, "validation_prompts": AIME_2024}
EVERY_20TH_VALIDATES_ON_AIME = {"validations_per_step": 0.05, "validation_prompts": AIME_2024}

# Per run: what the record leaves out (or contradicts), with the reason.
ASSUMPTIONS: dict[str, dict[str, Any]] = {
    "verl_doc_onestepoff_colocate_fsdp2_16xH20": {
        "prompt_len": MATH_PROMPT, "response_len_mean": DAPO_7B_MEAN,
        "response_len_max": 8192,  # the shipped script's cap; the doc's 20,480 contradicts it (record notes)
        **EVERY_10TH_VALIDATES_ON_AIME,  # the script: test_freq=10, val_kwargs.n=1, save_freq=-1
    },
    "verl_doc_fullyasync_colocate_64xH20": {
        "prompt_len": MATH_PROMPT, "response_len_mean": DAPO_7B_LONG_MEAN,
        # The colocate arm's layout is unpublished: the fully-async sibling scripts' values.
        # Gradient checkpointing is not among the hints: the planner's layout policy chooses it.
        "rollout_tp": 4, "train_parallelism": {"ulysses_sp": 4, "fsdp_size": 8},
        "gpu_memory_utilization": 0.8,  # as in the same authors' one-step-off script
        "token_budget": 2 * (2048 + 28672),  # verl DAPO recipe: 2 x (prompt + response) per GPU
        "dynamic_bsz": True,
        **EVERY_20TH_VALIDATES_ON_AIME,  # the sibling scripts: test_freq=20, val_kwargs.n=1, save_freq=-1
    },
    "verl_doc_fullyasync_colocate_qwen3_30b_a3b_128xH20": {
        "prompt_len": MATH_PROMPT, "response_len_mean": DAPO_30B_MEAN,
        # The sibling fully-async script: actor TP2 CP2 EP8, rollout TP4, everything offloaded.
        "rollout_tp": 4, "train_parallelism": {"tp": 2, "cp": 2, "ep": 8},
        "offload": {"actor_param": True, "actor_grad": True, "actor_optimizer": True, "ref_param": True},
        "gpu_memory_utilization": 0.8, "token_budget": 2 * (2048 + 8192), "dynamic_bsz": True,
        **EVERY_20TH_VALIDATES_ON_AIME,  # the sibling script: test_freq=20, val_kwargs.n=1, save_freq=-1
    },
    "verl_doc_dpsk_deepseek_v3_671b_96xH20": {
        "prompt_len": MATH_PROMPT,  # mean response 1,960 and cap 9,632 are published
        "gpu_memory_utilization": 0.6,  # in the record's rollout_engine note
        # The script: test_freq=10 on aime-2024 (val_kwargs.n=1), save_freq=100 (Megatron dist checkpoint).
        **EVERY_10TH_VALIDATES_ON_AIME, "checkpoints_per_step": 0.01,
    },
    "verl_pr7833_qwen35_9b_gsm8k_8xB200": {
        "prompt_len": GSM8K_PROMPT, "response_len_mean": 400,  # a 2026 9B reasons longer than GSM8K_MEAN
        "model": "qwen3-8b",  # Qwen3.5-9B's text stack approximated by Qwen3-8B's shape (8.2B of 9B weights)
        # The published step is the mean of steps 2-6 of a 6-step run (total_training_steps=6) of the script with
        # test_freq=5 and save_freq=20: steps 5 and 6 (the last) validate on GSM8K's test split, step 6 (the last,
        # save_freq > 0) writes a checkpoint: 2 validations and 1 checkpoint in the 5 averaged steps.
        "validations_per_step": 2 / 5, "validation_prompts": GSM8K_TEST, "checkpoints_per_step": 1 / 5,
    },
    # Held out (HELD_OUT_RUNS). Geo3K's prompt: the problem text with verl's geo3k instruction (<think> tags,
    # \boxed{} answer) in the chat template, ~120 text tokens; one diagram, small (Geometry3K's are a few hundred
    # pixels a side): ~128 visual tokens at Qwen3.5's 32 x 32 pixels a token (patch 16, merge 2); a guess, +-2x.
    # The mean response is read off the run's own throughput (verl's perf/throughput: the batch's tokens, prompt
    # and response, per GPU-second): 143 x 290 s x 8 GPUs / 160 samples = 2,074 tokens a sample, less the
    # 248-token prompt: ~1,830 of the 2,048 cap (Qwen3.5 reasons at length). Unpublished, assumed: one optimizer
    # step a batch (ppo_mini_batch_size = train_batch_size 32; a smaller one adds only optimizer steps), no
    # validation or checkpoint in steps 2-5, recompute as the planner's layout policy chooses.
    "verl_issue7203_qwen35_9b_geo3k_megatron_8xH800": {
        "prompt_len": 120, "image_tokens": 128, "response_len_mean": 1830,
    },
    "rocm_blog_verl_ppo_qwen2_7b_gsm8k_8xH100": {
        # The step is derived from tokens/GPU/s, so it scales with these two assumed lengths. Its average leaves out
        # the steps with step % 10 == 0 (the record), where validation and checkpoints fall: no step terms.
        "prompt_len": GSM8K_PROMPT, "response_len_mean": GSM8K_MEAN,
    },
}


def _record(record: dict[str, Any]) -> dict[str, Any]:
    """The record with the assumptions that change its fields (not just the planner's defaults)."""
    extra = ASSUMPTIONS.get(record["id"], {})
    merged = dict(record)
    if "offload" in extra:
        merged["offload"] = {**(record.get("offload") or {}), **extra["offload"]}
    if extra.get("dynamic_bsz"):
        merged["micro_batch"] = {**(record.get("micro_batch") or {}), "use_dynamic_bsz": True}
    if "grad_checkpointing" in extra:
        merged["grad_checkpointing"] = extra["grad_checkpointing"]
    return merged


def records_with_assumptions(path: Path = RUNS) -> list[dict[str, Any]]:
    """The records with this script's assumptions merged in (the planner-only ones under "hybridflow"),
    so that ``hybridflow calibrate --published`` on them costs exactly what this script costs."""
    merged = []
    for record in json.loads(path.read_text()):
        extra = {k: v for k, v in ASSUMPTIONS.get(record["id"], {}).items()
                 if k not in ("offload", "dynamic_bsz", "grad_checkpointing")}
        merged.append({**_record(record), "hybridflow": {**(record.get("hybridflow") or {}), **extra}})
    return merged


def load_cases(path: Path = RUNS) -> list[MeasuredCase]:
    return [case_from_record(record) for record in records_with_assumptions(path)]


# Held out from the fit: the same doc table's other colocated arms (verl docs/advance/fully_async.md,
# "Asynchronous Training on 7B Model", doc commit b25bb7d4f), the 64-GPU run's experiment on 32 and 128 H20s.
# They are costed with the 64-GPU run's record and assumptions, only the GPU count changed. Their own total
# times show their lengths grew over training (32 GPUs: 8.2 min a step over steps 1-200, 17-19 min over
# 201-400; 128 GPUs: 5.2 -> 7.0 min), which the shared mean (DAPO_7B_MEAN) does not follow.
HELD_OUT = {
    "verl_doc_fullyasync_colocate_64xH20": {
        32: {"step": 790.10, "gen": 357.41, "old_log_prob": 107.71, "update_actor": 269.80},
        128: {"step": 356.30, "gen": 177.85, "old_log_prob": 53.92, "update_actor": 113.81},
    },
}


def held_out_cases(path: Path = RUNS, held_out_runs: Path = HELD_OUT_RUNS) -> list[MeasuredCase]:
    """The held-out arms (``HELD_OUT``) as cases, their base record with the GPU count and timings replaced, and
    the runs of ``held_out_runs`` (never fitted)."""
    cases = [case_from_record({**record, "id": f"{record['id']} (held out)"})
             for record in records_with_assumptions(held_out_runs)]
    for record in records_with_assumptions(path):
        for gpus, timings in HELD_OUT.get(record["id"], {}).items():
            nodes = gpus // int(record["gpus"]["gpus_per_node"])
            arm = {**record, "id": f"{record['id']} @ {gpus} GPUs (held out)", "timings_s": timings,
                   "gpus": {**record["gpus"], "count": gpus, "nodes": nodes}}
            cases.append(case_from_record(arm))
    return cases


def table(cases: list[MeasuredCase], calibrations: dict[str, Calibration | None]) -> list[dict[str, Any]]:
    rows = []
    for case in cases:
        predictions = {name: case.predict(calibration) for name, calibration in calibrations.items()}
        for key, seconds in case.measured.items():
            row = {"run": case.id, "phase": key, "published_s": seconds}
            row.update({name: predicted.get(key, float("nan")) for name, predicted in predictions.items()})
            rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]], names: list[str], *, markdown: bool) -> None:
    header = ["run", "phase", "published s", *(f"{name} s (ratio)" for name in names)]
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
    else:
        print("  ".join(f"{h:>22}" if i > 1 else f"{h:<45}" for i, h in enumerate(header)))
    for row in rows:
        cells = [row["run"], row["phase"], f"{row['published_s']:.0f}"]
        cells += [f"{row[name]:.0f} ({row[name] / row['published_s']:.2f}x)" for name in names]
        if markdown:
            print("| " + " | ".join(cells) + " |")
        else:
            print("  ".join(f"{c:>22}" if i > 1 else f"{c:<45}" for i, c in enumerate(cells)))


def verdict(rows: list[dict[str, Any]], name: str) -> str:
    steps = [abs(math.log(r[name] / r["published_s"])) for r in rows if r["phase"] == "step"]
    phases = [abs(math.log(r[name] / r["published_s"])) for r in rows if r["phase"] != "step"]
    worst_step, worst_phase = math.exp(max(steps, default=0)), math.exp(max(phases, default=0))
    ok = worst_step <= 1.5 and worst_phase <= 2.0
    return (f"{name}: worst step ratio {worst_step:.2f}x (target 1.5x), worst phase {worst_phase:.2f}x "
            f"(target 2x): {'MET' if ok else 'NOT MET'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=Path, default=RUNS)
    parser.add_argument("--fit", action="store_true", help="fit the shared calibration on these runs")
    parser.add_argument("--write-calibration", type=Path, help="where --fit writes the calibration")
    parser.add_argument("--per-device", action="store_true",
                        help="with --fit: also fit constants per device class with >= 3 runs (H20 here)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--export-records", type=Path,
                        help="write the records with these assumptions merged, for `hybridflow calibrate --published`")
    parser.add_argument("--companions", action="store_true",
                        help="cost the companion split runs in their own modes (benchmarks/published_pairs.py)")
    parser.add_argument("--held-out", action="store_true",
                        help="cost the held-out arms (HELD_OUT) with the shipped calibration; nothing is fitted")
    args = parser.parse_args(argv)
    if args.held_out:
        held = held_out_cases(args.runs)
        print_table(table(held, {"priors": None, "calibrated": Calibration.load("verl-published")}),
                    ["priors", "calibrated"], markdown=args.markdown)
        return 0
    if args.companions:
        from published_pairs import main as pairs_main  # imports this module: only on demand

        for name in ("priors", "verl-published"):
            pairs_main(["--runs", str(args.runs), "--calibration", name])
        return 0
    if args.export_records:
        args.export_records.write_text(json.dumps(records_with_assumptions(args.runs), indent=1) + "\n")
    cases = load_cases(args.runs)
    calibrations: dict[str, Calibration | None] = {"priors": None}
    if args.fit:
        devices = [case.device for case in cases] if args.per_device else None
        fitted = fit_calibration([(case.predict, case.measured) for case in cases], names=FITTED, held=PUBLISHED_HELD,
                                 devices=devices, source="benchmarks/published_runs.py --fit")
        calibrations["calibrated"] = fitted
        if args.write_calibration:
            fitted.save(args.write_calibration)
        print("fitted:", json.dumps(fitted.to_dict()), file=sys.stderr)
    else:
        calibrations["calibrated"] = Calibration.load("verl-published")
    rows = table(cases, calibrations)
    print_table(rows, list(calibrations), markdown=args.markdown)
    for name in calibrations:
        print(verdict(rows, name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
