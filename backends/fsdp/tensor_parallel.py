"""Tensor parallelism of a Hugging Face decoder with torch-native DTensor (``parallelize_module``).

Megatron's split of each transformer block, the plan torchtitan applies to Llama: the attention's query, key
and value projections and the MLP's gate and up projections are column-parallel (each rank holds
``1/tp`` of their output features: whole heads, whole MLP channels), the attention's output projection and
the MLP's down projection are row-parallel (each rank multiplies its slice, one all-reduce sums them). Between
blocks every rank holds the whole hidden state, so the embeddings, norms and heads (``lm_head``, a critic's or
reward model's ``score``) stay replicated: their weights are tied or small, and their outputs (logits,
values, scores) come out whole on every rank, which the loss reads unchanged.

The attention reshapes its projections with ``view(..., -1, head_dim)``, so each rank's module sees its local
heads; head counts a module stores as attributes (older HF modules kept ``num_heads``) are divided too.
"""

from __future__ import annotations

from typing import Any

import torch

# Module paths inside a decoder block (Qwen2, Llama, Mistral, Qwen3 name them alike) -> their split.
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
_HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads")


def check_divisible(config: Any, tp: int, *, role: str) -> None:
    """Raise unless ``tp`` divides the attention and key-value heads and the MLP width of ``config``."""
    sizes = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
             "intermediate_size": config.intermediate_size}
    bad = {name: size for name, size in sizes.items() if size % tp}
    if bad:
        raise ValueError(f"RoleLayout({role}).tp={tp} must divide the model's {bad} (each rank holds whole heads); "
                         f"choose tp among the common divisors")


def apply_tensor_parallel(blocks: list[torch.nn.Module], tp_mesh: Any, *, config: Any, role: str) -> None:
    """Split every block of ``blocks`` over ``tp_mesh`` (in place): column- then row-parallel projections."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    check_divisible(config, tp, role=role)
    for block in blocks:
        names = {name for name, _ in block.named_modules()}
        missing = [path for path in COLWISE + ROWWISE if path not in names]
        if missing:
            raise ValueError(f"role {role!r}: tensor parallelism splits {list(COLWISE + ROWWISE)} of each decoder "
                             f"block; {type(block).__name__} has no {missing} (set tp=1 for this model)")
        for path in COLWISE + ROWWISE:
            if not isinstance(block.get_submodule(path), torch.nn.Linear):
                raise TypeError(f"role {role!r}: {type(block).__name__}.{path} is a "
                                f"{type(block.get_submodule(path)).__name__}, not a Linear (LoRA adapters and "
                                "quantised layers are not tensor-parallel here); set tp=1")
        plan: dict[str, Any] = {path: ColwiseParallel() for path in COLWISE}
        plan.update({path: RowwiseParallel() for path in ROWWISE})
        parallelize_module(block, tp_mesh, plan)
        attention = block.get_submodule("self_attn")
        for name in _HEAD_ATTRIBUTES:
            if isinstance(getattr(attention, name, None), int):
                setattr(attention, name, getattr(attention, name) // tp)


def grad_norm(parameters: list[torch.nn.Parameter], world_size: int) -> torch.Tensor:
    """The 2-norm of the whole gradient, whatever mesh each parameter's DTensor lives on.

    Under FSDP2 x TP the split projections are DTensors on the (data, tensor) mesh and the replicated ones on
    the data mesh alone, which ``clip_grad_norm_``'s grouped norms cannot mix. Each rank sums the squares of
    its local shards, each divided by the ranks holding the same shard, and one all-reduce adds them up.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    total = torch.zeros((), dtype=torch.float64)
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        local, copies = grad, world_size
        if isinstance(grad, DTensor):
            local = grad.to_local()
            shards = 1
            for size, placement in zip(grad.device_mesh.shape, grad.placements, strict=True):
                shards *= 1 if placement.is_replicate() else size  # FSDP x TP shards are _StridedShard
            copies = world_size // shards
        total += local.detach().double().pow(2).sum().cpu() / copies
    if dist.is_initialized():
        total = total.to(_collective_device())
        dist.all_reduce(total)
    return total.sqrt().float().cpu()


def clip_gradients(parameters: list[torch.nn.Parameter], max_norm: float, world_size: int) -> torch.Tensor:
    """Scale the gradients so their whole 2-norm is at most ``max_norm``; returns the norm before clipping."""
    norm = grad_norm(parameters, world_size)
    scale = max_norm / (float(norm) + 1e-6)
    if scale < 1.0:
        for param in parameters:
            if param.grad is not None:
                param.grad.mul_(scale)
    return norm


def _collective_device() -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
