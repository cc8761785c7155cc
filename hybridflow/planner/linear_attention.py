"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): the token mixer of a hybrid model's linear layers.

A hybrid decoder (transformers' ``Qwen3NextGatedDeltaNet``, used by Qwen3.5) runs Gated DeltaNet in most layers and
full (gated, grouped-query) attention in every ``full_attention_interval``-th one. A GDN layer projects the hidden
state to q, k (``key_heads x key_head_dim`` each), v and an output gate z (``value_heads x value_head_dim`` each)
and per value head a decay and a write strength (``in_proj_qkvz``, ``in_proj_ba``), runs a short causal depthwise
convolution over q, k, v (``conv_kernel`` taps), the delta rule over a ``key_head_dim x value_head_dim`` state per
value head, a gated RMSNorm and ``out_proj``. So a token costs its projections plus a state update of
O(value_heads x d_k x d_v), with no term growing with the context, and decoding reads and writes a fixed-size state
(kept in fp32: ``mamba_ssm_dtype``) instead of a KV cache that grows a token at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.planner.settings import check_positive_int

# flash-linear-attention's chunked gated delta rule (``chunk_gated_delta_rule``, the kernel transformers, Megatron
# and SGLang call for prefill and training) works in chunks of 64 tokens (fla/ops/gated_delta_rule).
GDN_CHUNK = 64


@dataclass(frozen=True, kw_only=True)
class LinearAttentionSpec:
    """The Gated DeltaNet layers of a hybrid model (HF ``text_config`` names in comments)."""

    layers: int  # layer_types.count("linear_attention")
    key_heads: int  # linear_num_key_heads
    value_heads: int  # linear_num_value_heads
    key_head_dim: int  # linear_key_head_dim
    value_head_dim: int  # linear_value_head_dim
    conv_kernel: int = 4  # linear_conv_kernel_dim
    state_bytes: int = 4  # mamba_ssm_dtype float32: the recurrent state's bytes per element

    def __post_init__(self) -> None:
        for name in ("layers", "key_heads", "value_heads", "key_head_dim", "value_head_dim", "conv_kernel",
                     "state_bytes"):
            check_positive_int("LinearAttentionSpec", name, getattr(self, name), allow_none=False)
        if self.value_heads % self.key_heads:
            raise ValueError(f"LinearAttentionSpec: value_heads={self.value_heads} must be a multiple of "
                             f"key_heads={self.key_heads}")

    @property
    def key_width(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def value_width(self) -> int:
        return self.value_heads * self.value_head_dim

    def layer_params(self, hidden: int) -> int:
        """One GDN mixer's weights: in_proj_qkvz (q, k, v, z), in_proj_ba (b, a per value head), the depthwise
        conv over q, k, v, dt_bias and A_log, the gated norm's weight, out_proj."""
        conv_channels = 2 * self.key_width + self.value_width
        projections = hidden * (2 * self.key_width + 2 * self.value_width) + hidden * 2 * self.value_heads
        return (projections + conv_channels * self.conv_kernel + 2 * self.value_heads + self.value_head_dim
                + self.value_width * hidden)

    @property
    def mixer_flops_per_token(self) -> float:
        """Forward FLOPs of one token's delta rule in one layer beyond its projections (chunked form, chunk ``C``):
        per value head the three state products (``w·S``, ``q·S`` and the ``kᵀ·u`` update: 2·d_k·d_v each) and the
        intra-chunk terms (``k·kᵀ`` and ``q·kᵀ`` over the chunk, 2·C·d_k each; their products with v, 2·C·d_v
        each). Constant in the context: no O(n²) attention term."""
        dk, dv = self.key_head_dim, self.value_head_dim
        return self.value_heads * (6 * dk * dv + 4 * GDN_CHUNK * (dk + dv))

    @property
    def state_bytes_per_sequence(self) -> int:
        """Decode state of one sequence, all GDN layers: the delta-rule state (value_heads x d_k x d_v, fp32) and
        the convolution's last ``conv_kernel - 1`` inputs (bf16)."""
        recurrent = self.value_heads * self.key_head_dim * self.value_head_dim * self.state_bytes
        conv = (2 * self.key_width + self.value_width) * (self.conv_kernel - 1) * 2
        return self.layers * (recurrent + conv)


def linear_attention_from_config(config: dict[str, Any], *, name: str) -> LinearAttentionSpec | None:
    """The GDN layers of a hybrid config (``layer_types`` or ``full_attention_interval`` with ``linear_*`` keys);
    None for a config without linear attention."""
    if not config.get("linear_num_value_heads"):
        return None
    layers = int(config.get("num_hidden_layers") or 0)
    types = config.get("layer_types")
    if types:
        linear = sum(1 for kind in types if kind == "linear_attention")
    else:
        interval = int(config.get("full_attention_interval") or 0)
        if interval <= 0:
            raise ValueError(f"HF config of {name!r}: linear_num_value_heads without layer_types or "
                             "full_attention_interval; add one to say which layers are full attention")
        linear = layers - layers // interval
    if not 0 < linear < layers:
        raise ValueError(f"HF config of {name!r}: {linear} linear-attention layers of {layers}; a hybrid needs "
                         "both kinds (fix layer_types or full_attention_interval)")
    try:
        return LinearAttentionSpec(layers=linear, key_heads=int(config["linear_num_key_heads"]),
                                   value_heads=int(config["linear_num_value_heads"]),
                                   key_head_dim=int(config["linear_key_head_dim"]),
                                   value_head_dim=int(config["linear_value_head_dim"]),
                                   conv_kernel=int(config.get("linear_conv_kernel_dim") or 4),
                                   state_bytes=2 if config.get("mamba_ssm_dtype") in ("bfloat16", "float16") else 4)
    except KeyError as err:
        raise ValueError(f"HF config of {name!r} lacks {err}; a linear-attention config needs linear_num_key_heads, "
                         "linear_num_value_heads, linear_key_head_dim and linear_value_head_dim") from err
