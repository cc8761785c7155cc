"""The parts of ``benchmarks/gpu_check.py``, each run in a process of its own (a crash or hang hides nothing else).

``python benchmarks/gpu_check_parts.py --part NAME --mode cuda|cpu --work DIR --result FILE`` runs one part and
writes its result (JSON) to FILE; ``--part model`` first builds the random-init model every other part loads.
A GRPO part runs ``hybridflow.train.loop.train`` on a plan the planner costed for exactly the layout the part
pins (backend, sharding, bf16, packing, gradient checkpointing, LoRA, offload), then re-costs that plan with the
lengths the run generated (``settings_as_run``, what ``hybridflow calibrate`` does with a run directory) and
puts the prediction of every measured phase, and of the GPU's peak memory, beside the measured ones.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_calibrate import hf_config

MODELS = {"cuda": "qwen2.5-0.5b", "cpu": "tiny-qwen2"}  # the real shape on a GPU, the tiny model on a CPU
LORA = {"rank": 8, "alpha": 16}
OFFLOAD = ("params", "grads", "optimizer")
ATTENTION_GAP = 0.05  # mean |packed - padded| bf16 log-prob bound; both round to bf16 per layer
SKIP_STEPS = 1  # the first step pays lazy initialisation (kernels, allocator); the rest are measured


@dataclass(frozen=True, kw_only=True)
class Workload:
    """Prompts per step (x ``samples``), new tokens, rows per micro batch, steps."""

    prompts: int
    samples: int
    new_tokens: int
    micro_batch: int
    steps: int


WORKLOADS = {"cuda": Workload(prompts=8, samples=4, new_tokens=96, micro_batch=8, steps=3),
             "cpu": Workload(prompts=4, samples=4, new_tokens=12, micro_batch=8, steps=3)}


@dataclass(frozen=True, kw_only=True)
class Part:
    """One check: a GRPO run of the policy on ``backend`` with this layout, or the attention-kernel check."""

    name: str
    summary: str
    backend: str = "torch"
    sharding: str = "NO_SHARD"
    checkpointing: bool = False
    lora: bool = False
    offload: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()  # Python modules it imports; absent: skipped
    cuda_only: str = ""  # why it means nothing on a CPU (skipped there)
    cpu_skip: str = ""  # why CPU mode leaves it out although it could run


PARTS = (
    Part(name="attention", summary="packed vs padded bf16 log-probs, packed attention forced onto the flash kernel",
         cuda_only="the flash attention kernel is CUDA's"),
    Part(name="torch", summary="GRPO, torch backend, packed, no recomputation"),
    Part(name="torch-checkpointing", summary="GRPO, torch backend, packed, gradient checkpointing",
         checkpointing=True),
    Part(name="fsdp2", summary="GRPO, FSDP2 FULL_SHARD on one rank (NCCL; gloo on a CPU)", backend="fsdp",
         sharding="FULL_SHARD"),
    Part(name="fsdp2-offload", summary="GRPO, FSDP2 with parameters, gradients and optimizer in host memory",
         backend="fsdp", sharding="FULL_SHARD", offload=OFFLOAD,
         cuda_only="CPUOffloadPolicy needs an accelerator (on a CPU every tensor is in host memory already)"),
    Part(name="lora", summary="GRPO, torch backend, LoRA rank 8 (the reference is the adapters' base)", lora=True),
    Part(name="deepspeed-zero2", summary="GRPO, DeepSpeed ZeRO-2 on one rank", backend="deepspeed",
         sharding="ZERO2", needs=("deepspeed",), cpu_skip="DeepSpeed JIT-compiles its ops on a CPU (~1 min)"),
    Part(name="deepspeed-zero3", summary="GRPO, DeepSpeed ZeRO-3 on one rank", backend="deepspeed",
         sharding="ZERO3", needs=("deepspeed",), cpu_skip="DeepSpeed JIT-compiles its ops on a CPU (~1 min)"),
)


def part_named(name: str) -> Part:
    for part in PARTS:
        if part.name == name:
            return part
    raise KeyError(f"unknown part {name!r}; parts: {[p.name for p in PARTS]}")


def build_model(mode: str, folder: Path) -> dict[str, Any]:
    """A random-init policy (Qwen2.5-0.5B's config on a GPU, no download; the tiny Qwen2 on a CPU) saved with the
    character tokenizer, whose ids it keeps for pad, BOS and EOS."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridflow.data import char_tokenizer
    from hybridflow.models import build_tiny_causal_lm, save_model_dir
    from hybridflow.planner import ModelSpec

    tokenizer = char_tokenizer()
    ids = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
           "eos_token_id": tokenizer.eos_token_id}
    if mode == "cpu":
        model = build_tiny_causal_lm(MODELS[mode], vocab_size=len(tokenizer), **ids)
    else:
        shape = {k: v for k, v in hf_config(ModelSpec.preset(MODELS[mode])).items()
                 if k not in ("architectures", "model_type", "torch_dtype")}
        config = AutoConfig.for_model("qwen2", **shape, **ids, attention_dropout=0.0)
        torch.manual_seed(0)
        with torch.device("cuda"):  # initialising 0.5B parameters on the GPU takes a second, not ten
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    save_model_dir(model, tokenizer, folder)
    return {"model": MODELS[mode], "parameters": sum(p.numel() for p in model.parameters()),
            "environment": environment(mode)}


def environment(mode: str) -> dict[str, str]:
    """Versions and the device, for the report's header."""
    import importlib.metadata
    import platform

    import torch

    import hybridflow

    found = {"python": platform.python_version(), "hybridflow": str(Path(hybridflow.__file__).parent)}
    for package in ("torch", "transformers", "peft", "deepspeed", "flash-attn"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "absent"
    if mode == "cuda":
        found["device"] = torch.cuda.get_device_name(0)
        found["cuda"] = str(torch.version.cuda)
    else:
        found["device"] = f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
    return found


def check_attention(model_dir: Path, device: str = "cuda") -> dict[str, Any]:
    """The backends' packed forward (:mod:`hybridflow.backends.common.varlen`) with SDPA restricted to the flash
    kernel, against the padded forward (SDPA with a mask, another kernel), on ragged bf16 rows."""
    import torch
    from hybridflow.backends.common import modeling
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hybridflow.data import char_tokenizer
    from hybridflow.graph import RoleKind
    from hybridflow.runtime.batch import Batch

    model = modeling.load_model(RoleKind.FROZEN_POLICY, str(model_dir), dtype="bf16").to(device).eval()
    prompts, responses = torch.tensor([5, 17, 11, 32]), torch.tensor([40, 9, 64, 23])
    gen, vocab = torch.Generator().manual_seed(0), len(char_tokenizer())
    prompt_mask = (torch.arange(32)[None, :] >= 32 - prompts[:, None]).long()  # left-padded prompts
    response_mask = (torch.arange(64)[None, :] < responses[:, None]).long()  # right-padded responses
    rows = {"prompts": torch.randint(3, vocab, (4, 32), generator=gen) * prompt_mask, "prompt_mask": prompt_mask,
            "responses": torch.randint(3, vocab, (4, 64), generator=gen) * response_mask,
            "response_mask": response_mask}
    batch = Batch({name: tensor.to(device) for name, tensor in rows.items()})
    with torch.no_grad():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # raises if the packed pieces cannot run on flash
            packed = modeling.policy_outputs(model, batch, with_entropy=False, packed=True)["logprobs"]
        padded = modeling.policy_outputs(model, batch, with_entropy=False, packed=False)["logprobs"]
    gap = (packed.float() - padded.float()).abs()[batch["response_mask"].bool()]
    result = {"attention_implementation": model.config._attn_implementation, "sdpa_kernel": "FLASH_ATTENTION",
              "mean_gap": float(gap.mean()), "max_gap": float(gap.max()), "tokens": len(gap)}
    if not math.isfinite(result["max_gap"]) or result["mean_gap"] > ATTENTION_GAP:
        raise AssertionError(f"packed and padded bf16 log-probs differ: mean {result['mean_gap']:.4f} "
                             f"(bound {ATTENTION_GAP}), max {result['max_gap']:.4f}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--part", required=True, help="'model' or a part name")
    parser.add_argument("--mode", choices=sorted(MODELS), required=True)
    parser.add_argument("--work", type=Path, required=True, help="model and run directories")
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.mode == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: --mode cuda but torch sees no CUDA device; run `make gpu-check-cpu` here")
    model_dir = args.work / "model"
    if args.part == "model":
        result = build_model(args.mode, model_dir)
    elif args.part == "attention":
        result = check_attention(model_dir)
    else:
        from gpu_check_grpo import run_grpo

        result = run_grpo(part_named(args.part), args.mode, model_dir, args.work / args.part,
                          WORKLOADS[args.mode], skip_steps=SKIP_STEPS, lora=LORA)
    args.result.write_text(json.dumps({**result, "part_seconds": time.perf_counter() - started}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
