"""What one token costs a pass, counted from the model's shape: matmul FLOPs and the memory-bound ops' HBM bytes.

The cost model (:mod:`hybridflow.planner.costs`) turns these into seconds on a device; ``docs/planner.md`` ("Forward
pass", "Update", "Memory-bound ops of a pass") writes the formulas out with their sources.
"""

from __future__ import annotations

from hybridflow.graph import RoleKind
from hybridflow.planner.models import ModelSpec
from hybridflow.planner.vision import VisionSpec

# Memory-bound (non-matmul) HBM traffic of one token's forward through a decoder layer as Hugging Face transformers
# runs it under bf16 autocast (modeling_qwen2.py / modeling_llama.py, the code verl's FSDP workers train): two
# RMSNorms computed in fp32 (cast up, square, mean, scale, cast down, weight: ~36 bytes per hidden unit each), the
# rotary embedding of q and k (~23), the q/k layout copies around flash-attention (~8) and its inputs and output
# (~5), two residual adds (6 each): ~120 bytes per hidden unit; and the MLP's SiLU(gate) * up (read 2 + 2 + 2, write
# 2 + 2: 10 bytes per intermediate unit). Backward moves about twice the forward's bytes, recomputation once more:
# the same ``passes`` as the FLOPs. These kernels run at the HBM roofline, so they cost what the matmuls do not
# count: ~5% more for a 7B pass on an H20 (37 FLOP/byte), ~30% on an H100 or B200 (~290 FLOP/byte); Ivanov et al.,
# "Data Movement Is All You Need" (MLSys 2021), measured such ops at 0.2% of BERT's FLOPs and ~37% of its time.
# Megatron's fused kernels (Transformer Engine) move fewer bytes than this count.
NONMATMUL_BYTES_PER_HIDDEN = 120
NONMATMUL_BYTES_PER_INTERMEDIATE = 10
# A policy's logits row per token (bf16), beside the head's matmul: verl's dp_actor divides it by the temperature in
# place (read + write) and runs its entropy (torch.compile'd) and log-prob (flash-attn's triton cross entropy)
# kernels over it (~3 reads): 5 passes of 2 bytes over the vocabulary.
LOGIT_BYTES_PER_VOCAB = 10
# The fraction of peak HBM bandwidth PyTorch's elementwise kernels reach on tensors of a micro batch's size (~20M
# elements): 3.3 TB/s of an H200's 4.8 for fp16 binary ops on (1024, 20480) (tile-ai/TileOPs#512, PyTorch 2.9.1),
# 2.5-2.8 TB/s of an H100's 3.35 for gathers and scatters (pytorch/FBGEMM#3993). Not the calibrated
# ``hbm_efficiency``, which decode's fit holds at its floor (0.30) for what else a decode step costs.
NONMATMUL_HBM_EFFICIENCY = 0.7

# FlashAttention's backward runs five matmuls of the forward's size (S = QK^T recomputed, dP, dV, dQ, dK) where the
# forward runs two: Dao, "FlashAttention-2" (arXiv:2307.08691), and its benchmarks' FLOP count (bwd = 2.5 x fwd).
ATTENTION_BACKWARD_RATIO = 2.5

LM_HEAD_KINDS = (RoleKind.POLICY, RoleKind.FROZEN_POLICY)  # a value or reward model's head is one column


def flops_per_token(model: ModelSpec, seq: float, passes: int, *, train: bool = False, head: bool = True) -> float:
    """FLOPs of one token through ``passes`` passes (1 forward, 3 forward + backward, 4 with recomputation): 2 per
    decoder-layer weight (:attr:`ModelSpec.layer_matmul_params`) and pass, the LM head's (``head``: a policy's; a
    value model's is one column) in at most 3 of them (recomputation reruns the checkpointed layers, not the head:
    Hugging Face's gradient checkpointing wraps the decoder layers alone), and causal attention ``2·L·heads·
    head_dim·seq`` in the full-attention layers (a hybrid's linear layers add :func:`linear_mixer_flops`, constant in
    ``seq``), whose backward costs ``ATTENTION_BACKWARD_RATIO`` forwards.

    Training a LoRA adapter (``train``) skips the frozen weights' gradients: their matmuls run one pass fewer
    (forward, input gradients, recomputation), attention all of its passes, the adapter's own ``passes``."""
    attention = 2 * model.attention_layers * model.heads * model.head_dim * seq + linear_mixer_flops(model)
    attention_passes = passes if passes == 1 else passes - 2 + ATTENTION_BACKWARD_RATIO
    head_passes = min(passes, 3) if head else 0
    if train and model.adapter is not None:
        weights = (passes - 1) * 2 * model.layer_matmul_params + max(head_passes - 1, 0) * 2 * model.head_params
        return weights + attention_passes * attention + passes * 2 * model.adapter_params
    return (passes * 2 * model.layer_matmul_params + head_passes * 2 * model.head_params
            + attention_passes * attention)


def linear_mixer_flops(model: ModelSpec) -> float:
    """Forward FLOPs of one token's delta rule over a hybrid's Gated DeltaNet layers beyond their projections
    (:attr:`LinearAttentionSpec.mixer_flops_per_token`); 0 for attention-only models. Its backward, like
    attention's, is taken at ``ATTENTION_BACKWARD_RATIO`` forwards (fla's chunked backward recomputes the states
    and runs the gradient products of each forward one)."""
    linear = model.linear_attention
    return linear.layers * linear.mixer_flops_per_token if linear is not None else 0.0


def nonmatmul_bytes_per_token(model: ModelSpec, kind: RoleKind, passes: int) -> float:
    """HBM bytes one token moves through the memory-bound ops of ``passes`` passes (``NONMATMUL_BYTES_PER_*``): the
    layers' norms, rotary, residuals and MLP activation, and a policy's logits row (``LOGIT_BYTES_PER_VOCAB``).
    An MoE token's MLP activation covers its routed width, which ``intermediate`` approximates for the presets."""
    width = model.intermediate or 4 * model.hidden
    layer = NONMATMUL_BYTES_PER_HIDDEN * model.hidden + NONMATMUL_BYTES_PER_INTERMEDIATE * width
    logits = LOGIT_BYTES_PER_VOCAB * model.vocab if kind in LM_HEAD_KINDS else 0
    return passes * (model.layers * layer + logits)


def vision_flops_per_token(vision: VisionSpec, image_tokens: float, passes: int) -> float:
    """FLOPs of one visual token through the tower in ``passes`` passes (1 forward: a frozen tower, even in an
    update, since nothing before it needs gradients; 3 or 4 when it trains): its ``spatial_merge²`` patches through
    the patch embedding and every block's matmuls (2 per weight), the merger's matmuls once, and bidirectional
    attention, ``4·hidden`` per patch and key (QK^T and AV), over a window's patches in the windowed blocks and
    the whole image's (``image_tokens`` visual tokens: one image a sample) in the others."""
    patches = vision.patches_per_token
    image_patches = max(image_tokens, 1.0) * patches
    window = min(float(vision.window_patches), image_patches) if vision.window_size else image_patches
    keys = vision.windowed_blocks * window + (vision.depth - vision.windowed_blocks) * image_patches
    attention = 4 * vision.hidden * keys
    matmuls = 2 * (vision.patch_inputs * vision.hidden + vision.depth * vision.block_matmul_params)
    attention_passes = passes if passes == 1 else passes - 2 + ATTENTION_BACKWARD_RATIO
    return patches * (passes * matmuls + attention_passes * attention) + passes * 2 * vision.merger_matmul_params


def vision_nonmatmul_bytes_per_token(vision: VisionSpec, passes: int) -> float:
    """HBM bytes one visual token's patches move through a block's memory-bound ops (RMSNorms, rotary, residuals,
    the gated MLP's activation: the kernels ``NONMATMUL_BYTES_PER_*`` count for a decoder layer)."""
    block = NONMATMUL_BYTES_PER_HIDDEN * vision.hidden + NONMATMUL_BYTES_PER_INTERMEDIATE * vision.intermediate
    return passes * vision.patches_per_token * vision.depth * block
