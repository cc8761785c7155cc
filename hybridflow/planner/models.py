"""Model shapes the cost model needs: parameters, layers, hidden size, heads, KV heads, vocabulary, and a
vision-language model's vision tower (:mod:`.vision`).

A :class:`ModelSpec` comes from a preset (public HF configs), a local ``config.json``, or a raw
parameter count (a Llama-like shape is derived).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hybridflow.files import read_json
from hybridflow.planner.linear_attention import LinearAttentionSpec, linear_attention_from_config
from hybridflow.planner.lora_costs import LoraPlan
from hybridflow.planner.vision import VisionSpec, qwen2_5_vl_tower, vision_from_config


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer's shape. ``params`` counts every weight of the language model, embeddings
    included; a vision-language model's tower (``vision``) is counted apart (:attr:`vision_params`)."""

    name: str
    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    intermediate: int = 0
    tie_embeddings: bool = False
    # Mixture of experts: FLOPs follow the active weights, memory the total. 0 means dense.
    active_params: int = 0  # weights one token runs through (0: all of ``params``)
    experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 0
    expert_params: int = 0  # weights held in routed experts, all layers together
    attention_head_dim: int = 0  # 0: hidden // heads (Qwen3 and DeepSeek-V3 set their own)
    kv_latent_dim: int = 0  # multi-head latent attention (DeepSeek-V3): cached width per layer and token
    # A LoRA adapter the role trains on this frozen base (``lora_costs.py``); None: every weight is trained.
    adapter: LoraPlan | None = None
    adapter_params: int = field(default=0, init=False, compare=False, repr=False)  # the adapter's weights
    vision: VisionSpec | None = None  # a vision-language model's vision tower; None: a text-only model
    # A hybrid model's Gated DeltaNet layers (``linear_attention.py``); the other layers are full attention.
    linear_attention: LinearAttentionSpec | None = None

    def __post_init__(self) -> None:
        for field_name in ("params", "layers", "hidden", "heads", "kv_heads", "vocab"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelSpec({self.name}).{field_name}={value!r} must be a positive integer")
        for field_name in ("active_params", "experts", "experts_per_token", "expert_params", "attention_head_dim",
                           "kv_latent_dim"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ModelSpec({self.name}).{field_name}={value!r} must be an integer >= 0")
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelSpec({self.name}): heads={self.heads} must be a multiple of "
                             f"kv_heads={self.kv_heads}")
        if self.active_params > self.params or self.expert_params > self.params:
            raise ValueError(f"ModelSpec({self.name}): active_params={self.active_params} and expert_params="
                             f"{self.expert_params} cannot exceed params={self.params}")
        if self.experts and not 0 < self.experts_per_token <= self.experts:
            raise ValueError(f"ModelSpec({self.name}).experts_per_token={self.experts_per_token} must be in "
                             f"1..experts={self.experts}")
        if self.vision is not None and not isinstance(self.vision, VisionSpec):
            raise TypeError(f"ModelSpec({self.name}).vision must be a VisionSpec, got {type(self.vision).__name__}")
        if self.linear_attention is not None and not (isinstance(self.linear_attention, LinearAttentionSpec)
                                                      and self.linear_attention.layers < self.layers):
            raise ValueError(f"ModelSpec({self.name}).linear_attention must be a LinearAttentionSpec of fewer than "
                             f"layers={self.layers} layers")
        if self.adapter is not None:
            if not isinstance(self.adapter, LoraPlan):
                raise TypeError(f"ModelSpec({self.name}).adapter must be a LoraPlan, got {type(self.adapter).__name__}")
            object.__setattr__(self, "adapter_params", self.adapter.trainable_params(self))

    @property
    def trainable_params(self) -> int:
        """Weights an update trains: the adapter's with LoRA, else all of them."""
        return self.adapter_params if self.adapter is not None else self.params

    def with_adapter(self, adapter: LoraPlan | None) -> ModelSpec:
        """This base with ``adapter`` trained on it (None: the plain model, fully trained)."""
        return replace(self, adapter=adapter)

    @property
    def vision_params(self) -> int:
        """The vision tower's weights (0 for a text-only model): held by every role that runs the model."""
        return self.vision.params if self.vision is not None else 0

    @property
    def trained_vision_params(self) -> int:
        """The tower's weights an update trains: 0 while it is frozen (the default, as verl)."""
        return self.vision_params if self.vision is not None and self.vision.trainable else 0

    @property
    def base(self) -> ModelSpec:
        """The frozen base without its adapter."""
        return self if self.adapter is None else replace(self, adapter=None)

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden // self.heads

    @property
    def attention_layers(self) -> int:
        """Layers of full (softmax) attention, which keep a KV cache and cost O(context) a token: all of them but a
        hybrid's linear-attention layers."""
        return self.layers - (self.linear_attention.layers if self.linear_attention is not None else 0)

    @property
    def state_bytes_per_sequence(self) -> int:
        """Decode state a sequence holds whatever its length (a hybrid's GDN states; 0 for attention-only)."""
        return self.linear_attention.state_bytes_per_sequence if self.linear_attention is not None else 0

    @property
    def active(self) -> int:
        """Weights each token is multiplied by: all of them for a dense model, the routed few for MoE."""
        return self.active_params or self.params

    @property
    def head_params(self) -> int:
        """The LM head's weights (vocabulary x hidden, tied or not): one matmul for every position whose logits are
        computed."""
        return self.vocab * self.hidden

    @property
    def layer_matmul_params(self) -> int:
        """Active weights a token is multiplied by in the decoder layers: the input embedding is a lookup, not a
        matmul, and the head is counted apart (:attr:`head_params`), since a value model has none and a prefill
        computes logits for one position a sequence."""
        embeddings = self.head_params * (1 if self.tie_embeddings else 2)
        return max(self.active - embeddings, 0)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def weight_tensors(self) -> int:
        """Named weight tensors, which a weight refresh moves one by one: per layer the attention's q, k, v, o,
        the MLP's gate, up, down and two norms, plus gate, up, down per routed expert; embeddings, the final
        norm and the head."""
        return self.layers * (9 + 3 * self.experts) + 3

    @property
    def active_expert_params(self) -> float:
        """Routed-expert weights one token runs through (``k/E`` of them)."""
        return self.expert_params * self.experts_per_token / self.experts if self.is_moe else 0.0

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every full-attention layer for one token (grouped-query attention stores ``kv_heads`` heads;
        latent attention one compressed vector per layer; a hybrid's linear layers keep a fixed-size state instead,
        :attr:`state_bytes_per_sequence`)."""
        if self.kv_latent_dim:
            return self.attention_layers * self.kv_latent_dim * dtype_bytes
        return 2 * self.attention_layers * self.kv_heads * self.head_dim * dtype_bytes

    def weights_read(self, tokens: float) -> float:
        """Weights a decode step over ``tokens`` sequences reads: dense parts always, each routed expert
        when at least one token picks it (uniform routing: ``1 - (1 - k/E)^tokens`` of them)."""
        if not self.is_moe:
            return float(self.params)
        touched = 1.0 - (1.0 - self.experts_per_token / self.experts) ** max(tokens, 1.0)
        return self.params - self.expert_params + self.expert_params * touched

    @classmethod
    def preset(cls, name: str) -> ModelSpec:
        """A known open model by name (``llama3-8b``, ``qwen2.5-7b``, ``tiny``...)."""
        key = name.strip().lower()
        if key not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; presets: {sorted(PRESETS)}, or give a path to a "
                             "config.json or a parameter count such as 7e9")
        return PRESETS[key]

    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelSpec:
        """Read a Hugging Face ``config.json`` (or the folder holding one)."""
        file = Path(path)
        if file.is_dir():
            file = file / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"no HF config at {file}")
        config = read_json(file, what="model config")
        if not isinstance(config, dict):
            raise ValueError(f"model config {str(file)!r} holds a {type(config).__name__}, not a Hugging Face config")
        return from_config_dict(config, name=str(config.get("_name_or_path") or file.parent.name or file.stem))

    @classmethod
    def from_params(cls, params: float, *, name: str | None = None) -> ModelSpec:
        """A Llama-like shape for ``params`` weights: hidden ≈ 128 × layers, 8 KV heads, 32k vocabulary."""
        if not 0 < params <= MAX_MODEL_PARAMS:
            raise ValueError(f"a model of {params:.3g} weights: a parameter count must be positive and at most "
                             f"{MAX_MODEL_PARAMS:.0e} (bf16 weights beyond it fill more memory than the planner's "
                             "largest cluster holds)")
        # Non-embedding weights ≈ 12·L·h² and h ≈ 128·L (the usual aspect ratio) give h ≈ (128·N/12)^(1/3).
        hidden = max(64, round((128 * params / 12) ** (1 / 3) / 64) * 64)
        layers = max(1, round(params / (12 * hidden * hidden)))
        heads = max(1, hidden // 128)
        kv_heads = math.gcd(heads, 8)
        return cls(name=name or f"{params:.3g}-params", params=int(params), layers=layers, hidden=hidden,
                   heads=heads, kv_heads=kv_heads, vocab=32000, intermediate=4 * hidden)

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        """A preset name, a path to a config.json (or its folder), or a parameter count (``7e9``, ``8B``)."""
        value = text.strip()
        if value.lower() in PRESETS:
            return PRESETS[value.lower()]
        if Path(value).exists():
            return cls.from_hf_config(value)
        count = _parse_count(value)
        if count is None:
            return cls.preset(value)
        if not math.isfinite(count) or count <= 0:
            raise ValueError(f"{value!r} is not a model name or size (a parameter count is a finite number > 0: 7e9, "
                             f"8B); known: {sorted(PRESETS)}, or a config.json path")
        return cls.from_params(count, name=value)


MAX_MODEL_PARAMS = 1e16  # 20 PB of bf16 weights: more than the largest cluster (1 << 17 GPUs of 141 GB) holds


def _parse_count(text: str) -> float | None:
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
    number, unit = (text[:-1], scale[text[-1].upper()]) if text and text[-1].upper() in scale else (text, 1.0)
    try:
        return float(number) * unit
    except ValueError:
        return None


def count_params(*, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, intermediate: int,
                 tie_embeddings: bool) -> int:
    """Weights of a Llama-style block stack: attention (q, k, v, o), gated MLP, two norms; embeddings."""
    head_dim = hidden // heads
    attention = hidden * hidden * 2 + 2 * hidden * kv_heads * head_dim
    mlp = 3 * hidden * intermediate
    embeddings = vocab * hidden * (1 if tie_embeddings else 2)
    return layers * (attention + mlp + 2 * hidden) + embeddings + hidden


def from_config_dict(config: dict[str, Any], *, name: str) -> ModelSpec:
    """A :class:`ModelSpec` from HF config keys (Llama/Qwen/Mistral names, GPT-2 names as a fallback;
    Qwen-MoE ``num_experts``/``moe_intermediate_size`` and an explicit ``head_dim``); a vision-language config
    (``vision_config``, its language model's keys top-level or under ``text_config``) gains its tower."""
    if isinstance(config.get("vision_config"), dict):
        text = {**config, **(config.get("text_config") or {})}
        text.pop("vision_config")
        spec = from_config_dict(text, name=name)
        return replace(spec, vision=vision_from_config(config["vision_config"], out_hidden=spec.hidden, name=name))
    hidden = _key(config, name, "hidden_size", "n_embd")
    layers = _key(config, name, "num_hidden_layers", "n_layer")
    heads = _key(config, name, "num_attention_heads", "n_head")
    vocab = _key(config, name, "vocab_size")
    kv_heads = int(config.get("num_key_value_heads") or heads)
    intermediate = int(config.get("intermediate_size") or config.get("n_inner") or 4 * hidden)
    tie = bool(config.get("tie_word_embeddings", False))
    head_dim = int(config.get("head_dim") or 0)
    experts = int(config.get("num_experts") or config.get("n_routed_experts") or 0)
    if head_dim and head_dim * heads != hidden:
        # Attention projections are heads x head_dim wide, not hidden: count them from a pseudo hidden size.
        attention_fix = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
        attention_fix -= hidden * hidden * 2 + 2 * hidden * kv_heads * (hidden // heads)
    else:
        attention_fix = 0
    if experts:
        top = int(config.get("num_experts_per_tok") or 1)
        expert_size = 3 * hidden * int(config.get("moe_intermediate_size") or intermediate)
        dense = count_params(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                             intermediate=0, tie_embeddings=tie) + layers * (attention_fix + hidden * experts)
        params, routed = dense + layers * experts * expert_size, layers * experts * expert_size
        active = dense + layers * top * expert_size
        return ModelSpec(name=name, params=params, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                         vocab=vocab, intermediate=intermediate, tie_embeddings=tie, active_params=active,
                         experts=experts, experts_per_token=top, expert_params=routed, attention_head_dim=head_dim)
    params = count_params(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                          intermediate=intermediate, tie_embeddings=tie) + layers * attention_fix
    linear = linear_attention_from_config(config, name=name)
    if linear is not None:
        # Hybrid (Qwen3-Next, Qwen3.5): the linear layers hold a GDN mixer where the others hold attention, whose
        # q_proj is twice as wide under attn_output_gate (a sigmoid gate on the attention output).
        width = heads * (head_dim or hidden // heads)
        attention = 2 * hidden * width + 2 * hidden * kv_heads * (head_dim or hidden // heads)
        gate = hidden * width if config.get("attn_output_gate") else 0
        params += (layers - linear.layers) * gate + linear.layers * (linear.layer_params(hidden) - attention)
    return ModelSpec(name=name, params=params, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                     vocab=vocab, intermediate=intermediate, tie_embeddings=tie, attention_head_dim=head_dim,
                     linear_attention=linear)


def _key(config: dict[str, Any], name: str, *keys: str) -> int:
    for key in keys:
        if config.get(key):
            return int(config[key])
    raise ValueError(f"HF config of {name!r} lacks {keys[0]!r}; need hidden_size, num_hidden_layers, "
                     "num_attention_heads and vocab_size")


def _preset(name: str, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, intermediate: int,
            tie: bool = False, **extra: int) -> ModelSpec:
    config: dict[str, Any] = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
                              "num_key_value_heads": kv_heads, "vocab_size": vocab, "intermediate_size": intermediate,
                              "tie_word_embeddings": tie, **extra}
    return from_config_dict(config, name=name)


def _vl_preset(name: str, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, intermediate: int,
               tie: bool = False) -> ModelSpec:
    """A Qwen2.5-VL size: its language model's shape and the Qwen2.5-VL tower."""
    spec = _preset(name, layers, hidden, heads, kv_heads, vocab, intermediate, tie)
    return replace(spec, vision=qwen2_5_vl_tower(hidden))


# DeepSeek-V3 (config.json + model card): 61 layers (3 dense), hidden 7168, 128 heads with latent attention
# (kv_lora_rank 512 + rope 64 cached per layer), 256 routed experts of width 2048, 8 per token, 1 shared;
# 671B weights, 37B active (the card's totals; MLA makes a shape count long for no gain here).
DEEPSEEK_V3 = ModelSpec(name="deepseek-v3", params=671_000_000_000, layers=61, hidden=7168, heads=128,
                        kv_heads=128, vocab=129280, intermediate=18432, active_params=37_000_000_000, experts=256,
                        experts_per_token=8, expert_params=58 * 256 * 3 * 7168 * 2048, attention_head_dim=128,
                        kv_latent_dim=576)


# Qwen/Qwen3.5-9B's config.json (Hugging Face Hub, revision c2022362, as a public test fixture reproduces it
# whole; the same linear_* keys and the 1-in-4 layout as slime's scripts/models/qwen3.5-4B/27B and transformers'
# Qwen3_5VisionConfig defaults for the tower). The checkpoint holds 9.653B weights: ~8.95B language model, ~0.45B
# tower, ~0.24B of one multi-token-prediction layer that RL training and this catalogue leave out.
QWEN3_5_9B_CONFIG: dict[str, Any] = {
    "text_config": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
                    "head_dim": 256, "intermediate_size": 12288, "vocab_size": 248320, "tie_word_embeddings": False,
                    "attn_output_gate": True, "full_attention_interval": 4,
                    "layer_types": ["linear_attention"] * 3 + ["full_attention"],  # x 8: see below
                    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32"},
    "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "patch_size": 16,
                      "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3, "out_hidden_size": 4096,
                      "num_position_embeddings": 2304},
}
QWEN3_5_9B_CONFIG["text_config"]["layer_types"] *= 8

# Shapes from each model's public config.json on the Hugging Face Hub.
PRESETS: dict[str, ModelSpec] = {
    "llama3-8b": _preset("llama3-8b", 32, 4096, 32, 8, 128256, 14336),
    "llama3-70b": _preset("llama3-70b", 80, 8192, 64, 8, 128256, 28672),
    "llama3.2-1b": _preset("llama3.2-1b", 16, 2048, 32, 8, 128256, 8192, tie=True),
    "llama3.2-3b": _preset("llama3.2-3b", 28, 3072, 24, 8, 128256, 8192, tie=True),
    "qwen2.5-0.5b": _preset("qwen2.5-0.5b", 24, 896, 14, 2, 151936, 4864, tie=True),
    "qwen2.5-1.5b": _preset("qwen2.5-1.5b", 28, 1536, 12, 2, 151936, 8960, tie=True),
    "qwen2.5-7b": _preset("qwen2.5-7b", 28, 3584, 28, 4, 152064, 18944),
    "qwen2.5-72b": _preset("qwen2.5-72b", 80, 8192, 64, 8, 152064, 29568),
    "mistral-7b": _preset("mistral-7b", 32, 4096, 32, 8, 32000, 14336),
    "qwen2-7b": _preset("qwen2-7b", 28, 3584, 28, 4, 152064, 18944),
    "qwen2.5-math-7b": _preset("qwen2.5-math-7b", 28, 3584, 28, 4, 152064, 18944),
    "qwen3-8b": _preset("qwen3-8b", 36, 4096, 32, 8, 151936, 12288, head_dim=128),
    "qwen3-30b-a3b": _preset("qwen3-30b-a3b", 48, 2048, 32, 4, 151936, 6144, head_dim=128, num_experts=128,
                             num_experts_per_tok=8, moe_intermediate_size=768),
    "deepseek-v3": DEEPSEEK_V3,
    "qwen3.5-9b": from_config_dict(QWEN3_5_9B_CONFIG, name="qwen3.5-9b"),
    # Qwen2.5-VL: each language model is the Qwen2.5 of its size (text keys of Qwen/Qwen2.5-VL-{3B,7B,32B,72B}-
    # Instruct's config.json), beside the one tower of vision.qwen2_5_vl_tower.
    "qwen2.5-vl-3b": _vl_preset("qwen2.5-vl-3b", 36, 2048, 16, 2, 151936, 11008, tie=True),
    "qwen2.5-vl-7b": _vl_preset("qwen2.5-vl-7b", 28, 3584, 28, 4, 152064, 18944),
    "qwen2.5-vl-32b": _vl_preset("qwen2.5-vl-32b", 64, 5120, 40, 8, 152064, 27648),
    "qwen2.5-vl-72b": _vl_preset("qwen2.5-vl-72b", 80, 8192, 64, 8, 152064, 29568),
    # The runtime's CPU test models (hybridflow.models.tiny): two layers, about 0.6M weights with a
    # 1k vocabulary; plan with ModelSpec.from_hf_config(saved_dir) to use the real tokenizer's vocabulary.
    "tiny": _preset("tiny", 2, 128, 4, 2, 1024, 512, tie=True),
    "tiny-qwen2": _preset("tiny-qwen2", 2, 128, 4, 2, 1024, 512, tie=True),
    "tiny-llama": _preset("tiny-llama", 2, 128, 4, 2, 1024, 512, tie=True),
    "tiny-qwen2-wide": _preset("tiny-qwen2-wide", 2, 256, 4, 2, 1024, 1024, tie=True),
}
