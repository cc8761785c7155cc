"""LoRA against full fine-tuning on CPU: learning (GRPO on ``reverse``), the update's size, memory and sync bytes.

    PYTHONPATH=. .venv/bin/python benchmarks/lora.py [--seeds 3] [--steps 50] [--variants full,lora_10x,...]

Learning: the GRPO run of ``benchmarks/learning_spread.py`` (same SFT-warmed tiny Qwen2, seeds 0..N-1) per variant
of :data:`VARIANTS` (full fine-tuning and LoRA rank 16, alpha 32, all-linear, at multiples of the full-FT lr
1e-3); the reward rise is the mean of the last 6 steps minus the first 6, the drift the mean over linear layers of
``|W_T - W_0| / |W_0|`` of the final (merged) policy. Verdict per LoRA variant: its mean rise within 2 standard
deviations of full fine-tuning's seed spread.
Update size: one Adam step of full FT and of LoRA at the same lr on the same batch; per linear module, LoRA's
``|dW|`` over full FT's against :func:`predicted_step_ratio`.
Memory: the torch trainer (the actor alone) after one update, each variant in a fresh process: AdamW state bytes
(8 per trainable weight) and peak RSS, on the tiny model and on a 31M-weight Qwen2 (hidden 512, 8 layers).
Sync: ``iter_adapter_weights`` bytes against ``iter_full_weights`` on the same engine, on the tiny model and on a
randomly initialised model of Qwen2.5-0.5B's shape, beside the planner's counts.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from learning_spread import run as spread_run  # noqa: E402
from learning_spread import warm_model  # noqa: E402

RANK, ALPHA = 16, 32.0
LORA = f"roles.actor.lora={{rank: {RANK}, alpha: {ALPHA}}}"
FULL_LR = 1e-3
# name -> (lr as a multiple of FULL_LR, LoRA?): full FT at 1x and at 4x (about the step LoRA takes at 10x here),
# LoRA at 1x, at the lr whose step matches full FT's (predicted_step_ratio: ~2.5x on this model) and the advised 10x.
VARIANTS: dict[str, tuple[float, bool]] = {"full": (1.0, False), "full_4x": (4.0, False), "lora_1x": (1.0, True),
                                           "lora_2.5x": (2.5, True), "lora_10x": (10.0, True)}
WIDE = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=True)  # benchmarks/backends.py's
QWEN05 = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, vocab_size=151936, max_position_embeddings=512, tie_word_embeddings=True)


def predicted_step_ratio(d_in: int, rank: int = RANK, alpha: float = ALPHA) -> float:
    """|dW| of LoRA's first Adam step over full FT's at the same lr, for a ``d_in``-input layer.

    Adam's first step moves every entry by ~lr: full FT's ``|dW|_F = lr·sqrt(d_out·d_in)``. LoRA's B starts at 0,
    so only B moves (``dB`` ~ lr per entry, ``d_out x r``) and ``dW = (alpha/r)·dB·A``, with peft's A uniform of
    bound ``1/sqrt(d_in)`` (rows of norm ``sqrt(1/3)``): ``|dW|_F ≈ (alpha/r)·lr·sqrt(d_out·r/3)``. The ratio,
    ``alpha / sqrt(3·r·d_in)``, is independent of the lr: the lr multiple that gives LoRA full FT's step is its
    inverse (2.4x at d_in = 128, 14x at 4096).
    """
    return alpha / math.sqrt(3 * rank * d_in)


def learning(variants: list[str], seeds: range, steps: int, model: Path, out: Path
             ) -> dict[str, list[dict[str, float]]]:
    """Reward rise and drift per seed of each variant (learning_spread's GRPO run, lr and lora varied)."""
    import learning_spread

    base_file, base_overrides = learning_spread.CURVE_RUNS["grpo"]
    overrides = [o for o in base_overrides if not o.startswith(("optim.actor.lr=", "steps="))]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for seed in seeds:  # seeds outermost: every variant sees the same stretch of machine load
        for name in variants:
            multiple, lora = VARIANTS[name]
            key = f"grpo_{name}"
            lr = f"optim.actor.lr={FULL_LR * multiple:g}"
            learning_spread.CURVE_RUNS[key] = (base_file, [*overrides, f"steps={steps}", lr, *([LORA] if lora else [])])
            shutil.rmtree(out / f"{key}_{seed}", ignore_errors=True)  # a rerun replaces the run
            row = spread_run(key, seed, model, out)
            row["drift"] = drift(model, out / f"{key}_{seed}" / "final")
            results[name].append(row)
            print(f"  {name} seed {seed}: rise {row['rise']:+.3f}, drift {row['drift']:.3f} ({row['seconds']:.0f} s)",
                  flush=True)
    return results


def drift(start: Path, end: Path) -> float:
    """Mean over linear weights of ``|W_end - W_start| / |W_start|`` (safetensors model dirs)."""
    from safetensors.torch import load_file

    before, after = load_file(str(start / "model.safetensors")), load_file(str(end / "model.safetensors"))
    return statistics.mean(float((after[name] - weight).norm() / weight.norm()) for name, weight in before.items()
                           if name.endswith("proj.weight"))


def _engine_measures(model: str, lora: bool, what: str, queue: Any) -> None:
    """The torch actor engine alone (fresh process). ``what``: ``memory`` (one update: Adam state bytes, the
    update's peak RSS, then counts and sync bytes), ``steps`` (one update's |dW| per linear layer: a snapshot of
    the weights would blur the memory measure, so it runs apart) or ``sync`` (counts and sync bytes only)."""
    from hybridflow.graph import Op
    from hybridflow.runtime import default_plan
    from hybridflow.runtime.batch import Batch
    from hybridflow.runtime.worker import GroupWorker
    from hybridflow.train.config import load_config
    from hybridflow.train.setup import build_graph, role_specs

    config = load_config(ROOT / "configs" / "grpo_reverse.yaml",
                         [f"optim.actor.lr={FULL_LR}", "optim.actor.mini_batches=1", "logging.progress=false",
                          *([LORA] if lora else [])])
    graph = build_graph(config)
    plan = default_plan(graph, num_gpus=1)
    worker = GroupWorker(group=0, rank=0, world_size=1, device="cpu",
                         specs=[role_specs(config, graph, model)["actor"]], layouts=[plan.layout("actor")])
    worker.setup()
    engine, nodes = worker.engines["actor"], {node.op: node for node in graph.nodes}
    found: dict[str, Any] = {}
    if what == "steps":
        before = {name: tensor.clone() for name, tensor in engine.iter_full_weights() if name.endswith("proj.weight")}
        one_update(worker, nodes, Op, Batch)
        steps: dict[str, list[float]] = {}
        for name, tensor in engine.iter_full_weights():
            if name in before:  # (d_out, d_in)
                module = name.split(".")[-2]
                steps.setdefault(module, [tensor.shape[1]]).append(float((tensor - before[name]).norm()))
        queue.put({"steps": {module: [values[0], statistics.mean(values[1:])] for module, values in steps.items()}})
        worker.close()
        return
    if what == "memory":
        reset_peak_rss()  # from here: the update's own peak (the model load's transient copies are behind us)
        found["loaded_rss_mib"] = rss_mib("VmRSS")
        one_update(worker, nodes, Op, Batch)
        found["update_peak_rss_mib"] = rss_mib("VmHWM")
        found.update(optimizer_bytes(engine.optimizer))
    params = {id(p): p for p in engine.model.parameters()}.values()
    tied = set(engine.tied_weights())  # a tied copy (lm_head = embeddings) travels as a name, not as bytes
    named_full = [(n, t.numel() * t.element_size()) for n, t in engine.iter_full_weights() if n not in tied]
    adapter = sum(t.numel() * t.element_size() for _, t in engine.iter_adapter_weights()) if lora else 0
    found.update(trainable=sum(p.numel() for p in params if p.requires_grad),
                 frozen=sum(p.numel() for p in params if not p.requires_grad),
                 full_bytes=sum(size for _, size in named_full), adapter_bytes=adapter,
                 embedding_bytes=sum(size for n, size in named_full if "embed" in n or "lm_head" in n))
    worker.close()
    queue.put(found)


def rss_mib(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak since start or :func:`reset_peak_rss`) of this process's own address
    space (``ru_maxrss`` would carry over the pages a spawned child shared with its parent before exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux >= 4.0: VmHWM restarts from the current RSS


def one_update(worker: Any, nodes: dict[Any, Any], op: Any, batch_type: Any) -> None:
    """One GRPO update on a fixed random batch (the same in every process: same gradient at the same weights)."""
    gen = torch.Generator().manual_seed(0)
    prompts, responses = torch.randint(4, 51, (16, 8), generator=gen), torch.randint(4, 51, (16, 8), generator=gen)
    rows = batch_type({"prompts": prompts, "prompt_mask": torch.ones_like(prompts), "responses": responses,
                       "response_mask": torch.ones_like(responses)})
    old = worker.run(nodes[op.LOGPROB], rows).outputs["old_logprobs"]
    fields = {"old_logprobs": old, "ref_logprobs": old, "loss_mask": rows["response_mask"],
              "advantages": torch.randn(old.shape, generator=gen)}
    worker.run(nodes[op.UPDATE], rows.union(batch_type(fields)))


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    moments = steps = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                size = value.numel() * value.element_size()
                moments, steps = (moments + size, steps) if key != "step" else (moments, steps + size)
    return {"moment_bytes": moments, "step_bytes": steps,
            "optimized": sum(p.numel() for group in optimizer.param_groups for p in group["params"])}


def engine_measures(model: Path, what: str, variants: tuple[str, ...] = ("full", "lora")) -> dict[str, dict[str, Any]]:
    context = multiprocessing.get_context("spawn")  # a fresh process each: peak RSS is the variant's own
    found = {}
    for name in variants:
        queue = context.Queue()
        process = context.Process(target=_engine_measures, args=(str(model), name == "lora", what, queue))
        process.start()
        found[name] = queue.get(timeout=900)
        process.join()
    return found


def random_model(out: Path, name: str, sizes: dict[str, Any]) -> Path:
    """A randomly initialised Qwen2 of ``sizes`` with the char tokenizer (its vocabulary if ``sizes`` has none)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridflow.data import char_tokenizer
    from hybridflow.models import save_model_dir

    target = out / name
    if not (target / "config.json").is_file():
        tokenizer = char_tokenizer()
        sizes = {"vocab_size": len(tokenizer), **sizes}
        config = AutoConfig.for_model("qwen2", pad_token_id=0, bos_token_id=1, eos_token_id=2, **sizes)
        torch.manual_seed(0)
        save_model_dir(AutoModelForCausalLM.from_config(config), tokenizer, target)
    return target


def planner_params(model: str | Path) -> tuple[int, int]:
    """The planner's adapter and whole parameter counts at rank 16 for a preset name or an HF directory."""
    from hybridflow.planner.lora_costs import LoraPlan
    from hybridflow.planner.models import ModelSpec

    spec = ModelSpec.from_hf_config(model) if isinstance(model, Path) else ModelSpec.preset(model)
    return LoraPlan(rank=RANK).trainable_params(spec), spec.params


def report_memory(label: str, measured: dict[str, dict[str, Any]]) -> dict[str, float]:
    full, lora = measured["full"], measured["lora"]
    print(f"## memory, {label} (torch actor, AdamW, one update)\n| variant | trainable | frozen | Adam moment bytes | "
          "8 x trainable | RSS after load MiB | update peak RSS MiB |\n|---|---|---|---|---|---|---|")
    for name, row in measured.items():
        print(f"| {name} | {row['trainable']:,} | {row['frozen']:,} | {row['moment_bytes']:,} | "
              f"{8 * row['trainable']:,} | {row['loaded_rss_mib']:.0f} | {row['update_peak_rss_mib']:.0f} |")
        assert row["moment_bytes"] == 8 * row["optimized"] == 8 * row["trainable"], row  # fp32 exp_avg + exp_avg_sq
    assert lora["frozen"] == full["trainable"]  # frozen = every base weight
    states = 8 * lora["frozen"] - lora["moment_bytes"]
    assert full["moment_bytes"] - lora["moment_bytes"] == states
    rss_drop = (full["update_peak_rss_mib"] - lora["update_peak_rss_mib"]) * 2**20
    expected = 12 * (lora["frozen"] - lora["trainable"])  # + 4 B of gradient per frozen weight
    print(f"Adam-state drop {states:,} B = 8 B x frozen - the adapters' own; update peak RSS drop "
          f"{rss_drop / 2**20:.0f} MiB "
          f"(gradients + moments of the frozen weights less the adapters': {expected / 2**20:.0f} MiB)")
    return {"state_drop": states, "rss_drop": rss_drop, "expected_rss_drop": expected}


def report_steps(label: str, measured: dict[str, dict[str, Any]]) -> dict[str, list[float]]:
    print(f"## update size, {label}: LoRA |dW| / full FT |dW| after one Adam step at the same lr\n"
          "| module | d_in | measured | predicted alpha/sqrt(3 r d_in) | lr multiple matching full FT |\n"
          "|---|---|---|---|---|")
    rows = {}
    for module, (d_in, full_step) in measured["full"]["steps"].items():
        ratio = measured["lora"]["steps"][module][1] / full_step
        rows[module] = [d_in, ratio, predicted_step_ratio(int(d_in))]
        print(f"| {module} | {int(d_in)} | {ratio:.3f} | {rows[module][2]:.3f} | {1 / ratio:.1f}x |")
    return rows


def report_sync(label: str, model: Path, lora: dict[str, Any]) -> dict[str, float]:
    planned, params = planner_params(model)
    ratio = lora["adapter_bytes"] / lora["full_bytes"]
    print(f"## sync bytes, {label} (rank {RANK}, all-linear, fp32)\nadapter {lora['adapter_bytes']:,} B / full "
          f"{lora['full_bytes']:,} B = {ratio:.2%} (target < 5%: {'met' if ratio < 0.05 else 'NOT met'}); embeddings "
          f"{lora['embedding_bytes'] / lora['full_bytes']:.0%} of the full bytes; planner: {planned:,} adapter weights "
          f"(measured {lora['trainable']:,}) of {params:,} ({planned / params:.2%}; measured whole "
          f"{lora['frozen']:,})")
    return {"ratio": ratio, "planned": planned, "planned_params": params, **lora}


def report_learning(runs: dict[str, list[dict[str, float]]]) -> None:
    rises = {name: [row["rise"] for row in rows] for name, rows in runs.items()}
    spread = {name: statistics.stdev(values) if len(values) > 1 else math.nan for name, values in rises.items()}
    print("## learning (GRPO, reverse)\n| variant | lr | rise per seed | mean | std | drift | s per run |\n"
          "|---|---|---|---|---|---|---|")
    for name, rows in runs.items():
        print(f"| {name} | {FULL_LR * VARIANTS[name][0]:g} | {', '.join(f'{r:+.3f}' for r in rises[name])} | "
              f"{statistics.mean(rises[name]):+.3f} | {spread[name]:.3f} | "
              f"{statistics.mean(row['drift'] for row in rows):.3f} | "
              f"{statistics.mean(row['seconds'] for row in rows):.0f} |")
    if "full" not in runs or len(rises["full"]) < 2:
        return  # no seed spread of full fine-tuning to compare with (a partial run: --first-seed, one seed)
    mean_full, std_full = statistics.mean(rises["full"]), spread["full"]
    for name in runs:
        if VARIANTS[name][1]:
            mean = statistics.mean(rises[name])
            within = abs(mean - mean_full) <= 2 * std_full
            print(f"verdict {name}: mean rise {mean:+.3f} is {'within' if within else 'OUTSIDE'} 2 std of full "
                  f"fine-tuning's ({mean_full:+.3f} +- {2 * std_full:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"learning variants, of {list(VARIANTS)}")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_lora")
    parser.add_argument("--skip-learning", action="store_true")
    parser.add_argument("--skip-measures", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = warm_model(args.out)
    results: dict[str, Any] = {}
    if not args.skip_measures:
        wide, qwen = random_model(args.out, "wide_31m", WIDE), random_model(args.out, "qwen2.5-0.5b_shape", QWEN05)
        for label, path in (("tiny (hidden 128)", model), ("31M (hidden 512)", wide)):
            measured = engine_measures(path, "memory")
            results[label] = {"memory": report_memory(label, measured),
                              "steps": report_steps(label, engine_measures(path, "steps")),
                              "sync": report_sync(label, path, measured["lora"])}
        qwen_sync = engine_measures(qwen, "sync", ("lora",))["lora"]
        results["qwen2.5-0.5b shape"] = {"sync": report_sync("Qwen2.5-0.5B shape (random init)", qwen, qwen_sync)}
        planned, params = planner_params("llama3-8b")
        print(f"planner, Llama-3-8B rank 16 all-linear: {planned:,} adapter weights / {params:,} = "
              f"{planned / params:.2%}")
    if not args.skip_learning:
        results["learning"] = learning(args.variants.split(","), range(args.first_seed, args.first_seed + args.seeds),
                                       args.steps, model, args.out)
        report_learning(results["learning"])
    (args.out / "lora.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
