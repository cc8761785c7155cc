"""Attention over packed sequences without an N² mask: ``sdpa`` run sequence by sequence.

Transformers keeps packed sequences apart (position ids restarting per sequence) in two ways: flash-attention
varlen on GPU (``cu_seq_lens``, no mask), or, with ``sdpa``/``eager`` (CPU, and GPUs without flash-attention),
a dense block-diagonal (1, 1, N, N) mask over the whole micro batch, so attention costs N² per layer however
short its sequences are. This module registers an attention implementation, :data:`NAME`, that does what
flash-attention varlen does with the kernels every install has: on a packed row it cuts query, key and value
at the sequence starts and runs causal ``sdpa`` on each piece (Σ lᵢ² instead of N², and no mask); on any
other input (padded rows, generation with a cache) it is transformers' ``sdpa``, mask and all.

On the CPU in half precision the backward runs in fp32 (:class:`_HalfForwardFloatBackward`): the CPU
flash-attention kernel's bf16 backward is slow on short sequences (32 x 88 tokens, 8 heads of 64: 56 ms a
layer, against 23 ms for the fp32 kernel including the casts, and 5 ms for the bf16 forward), and fp32 is the
more accurate of the two.

:func:`enable` switches a loaded model to it; models with sliding-window or chunked layers keep ``sdpa`` (their
masks are not plain causal). The name lives in the model's runtime config only: ``save_pretrained`` does not
write it, so an exported model loads anywhere.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

NAME = "hybridflow_sdpa_varlen"

_registered = False


def enable(model: Any) -> bool:
    """Run ``model``'s attention through :data:`NAME` where it now runs full-attention ``sdpa``; whether it did."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa" or not _full_attention(config):
        return False
    if not _register():
        return False
    model.set_attn_implementation(NAME)
    return True


def _full_attention(config: Any) -> bool:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(kind == "full_attention" for kind in layer_types)
    return not getattr(config, "use_sliding_window", False) and getattr(config, "attention_chunk_size", None) is None


def _register() -> bool:
    global _registered
    if not _registered:
        try:
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface
        except ImportError:  # transformers before the attention interfaces: keep sdpa's dense mask
            return False
        AttentionInterface.register(NAME, attention)
        AttentionMaskInterface.register(NAME, mask)
        _registered = True
    return True


def mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """No mask for rows without padding whose queries cover their keys (training and packed passes): the
    attention below is causal per sequence. Anything else gets ``sdpa``'s own mask."""
    from transformers.masking_utils import sdpa_mask

    q_length = kwargs.get("q_length")
    if q_length is None and kwargs.get("cache_position") is not None:  # transformers 4.x names it by positions
        q_length = kwargs["cache_position"].shape[0]
    whole = q_length is not None and q_length == kwargs.get("kv_length") and not kwargs.get("q_offset", 0) \
        and not kwargs.get("kv_offset", 0)
    if kwargs.get("attention_mask") is None and whole:
        return None
    return sdpa_mask(*args, **kwargs)


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``sdpa`` per packed sequence of a (1, heads, N, dim) row; transformers' ``sdpa`` on anything else."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = None
    if attention_mask is None and query.shape[0] == 1 and query.shape[2] == key.shape[2]:
        bounds = _sequence_bounds(kwargs.get("position_ids"))
    if bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError(f"{NAME} runs full attention only; enable() keeps sdpa for sliding windows")
    kwargs["is_causal"] = True
    # One split per tensor, not a slice per sequence: a slice's backward writes its gradient into a zeroed copy
    # of the whole row (N x sequences of memory traffic, the packed backward's main cost on CPU); a split's
    # backward is one concatenation.
    sizes = [end - start for start, end in bounds]
    if _float_backward(query, key, value, kwargs):
        return _HalfForwardFloatBackward.apply(query, key, value, tuple(sizes), kwargs.get("scaling")), None
    pieces = [sdpa_attention_forward(module, q, k, v, None, **kwargs)[0]
              for q, k, v in zip(query.split(sizes, dim=2), key.split(sizes, dim=2), value.split(sizes, dim=2),
                                 strict=True)]
    return torch.cat(pieces, dim=1), None  # (1, N, heads, dim), as sdpa returns it


_HALF = (torch.bfloat16, torch.float16)


def _float_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether a packed row takes :class:`_HalfForwardFloatBackward`: a CPU half-precision pass that will go
    backward, without dropout or a soft cap (which the kernel calls below do not take)."""
    return query.device.type == "cpu" and query.dtype in _HALF and torch.is_grad_enabled() \
        and any(tensor.requires_grad for tensor in (query, key, value)) and not kwargs.get("dropout") \
        and kwargs.get("softcap") is None


class _HalfForwardFloatBackward(torch.autograd.Function):
    """Causal attention per packed sequence with the CPU flash kernel: the forward in the inputs' dtype, keeping
    each query's log-sum-exp, the backward in fp32 from it (the same kernel's fp32 backward). Takes (1, heads, N,
    dim) query and (1, kv_heads, N, dim) key/value (grouped-query attention as the kernel does it); returns
    (1, N, heads, dim), as transformers' attention functions do."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sizes: tuple[int, ...],
                scale: float | None) -> torch.Tensor:
        outputs, lses = [], []
        for q, k, v in zip(query.split(sizes, dim=2), key.split(sizes, dim=2), value.split(sizes, dim=2), strict=True):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
            outputs.append(out)
            lses.append(lse)
        out = torch.cat(outputs, dim=2)
        ctx.save_for_backward(query, key, value, out, torch.cat(lses, dim=2))
        ctx.sizes, ctx.scale = sizes, scale
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, lse = ctx.saved_tensors
        tensors = (grad.transpose(1, 2), query, key, value, out)
        pieces = zip(*(tensor.float().split(ctx.sizes, dim=2) for tensor in tensors), lse.split(ctx.sizes, dim=2),
                     strict=True)
        grads = [torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, o, piece_lse, 0.0, True, scale=ctx.scale) for do, q, k, v, o, piece_lse in pieces]
        dq, dk, dv = (torch.cat(parts, dim=2).to(like.dtype) for parts, like in zip(zip(*grads, strict=True),
                                                                                      (query, key, value), strict=True))
        return dq, dk, dv, None, None


# Every layer of one forward gets the same position_ids tensor (and a checkpointed layer gets it again in the
# backward): the bounds are read off it once, on the host.
_last: tuple[weakref.ref[torch.Tensor], list[tuple[int, int]] | None] | None = None


def _sequence_bounds(position_ids: torch.Tensor | None) -> list[tuple[int, int]] | None:
    """[start, end) of each sequence of a packed (1, N) row (a new one wherever positions do not step by one,
    as transformers' ``find_packed_sequence_indices`` reads them); None for a single sequence."""
    global _last
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return None
    if _last is not None and _last[0]() is position_ids:
        return _last[1]
    steps = position_ids[0, 1:] - position_ids[0, :-1]
    starts = [0, *((steps != 1).nonzero().squeeze(1) + 1).tolist()]
    length = position_ids.shape[1]
    bounds = list(zip(starts, [*starts[1:], length], strict=True)) if len(starts) > 1 else None
    _last = (weakref.ref(position_ids), bounds)
    return bounds
