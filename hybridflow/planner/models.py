"""Model shapes the cost model needs: parameters, layers, hidden size, heads, KV heads, vocabulary.

A :class:`ModelSpec` comes from a preset (public HF configs), a local ``config.json``, or a raw
parameter count (a Llama-like shape is derived).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer's shape. ``params`` counts every weight, embeddings included."""

    name: str
    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    intermediate: int = 0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for field_name in ("params", "layers", "hidden", "heads", "kv_heads", "vocab"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelSpec({self.name}).{field_name}={value!r} must be a positive integer")
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelSpec({self.name}): heads={self.heads} must be a multiple of "
                             f"kv_heads={self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one token (grouped-query attention stores ``kv_heads`` heads)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

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
        config: dict[str, Any] = json.loads(file.read_text())
        return from_config_dict(config, name=str(config.get("_name_or_path") or file.parent.name or file.stem))

    @classmethod
    def from_params(cls, params: float, *, name: str | None = None) -> ModelSpec:
        """A Llama-like shape for ``params`` weights: hidden ≈ 128 × layers, 8 KV heads, 32k vocabulary."""
        if params <= 0:
            raise ValueError(f"ModelSpec.from_params: params={params} must be positive")
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
        if count is not None:
            return cls.from_params(count, name=value)
        return cls.preset(value)


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
    """A :class:`ModelSpec` from HF config keys (Llama/Qwen/Mistral names, GPT-2 names as a fallback)."""
    hidden = _key(config, name, "hidden_size", "n_embd")
    layers = _key(config, name, "num_hidden_layers", "n_layer")
    heads = _key(config, name, "num_attention_heads", "n_head")
    vocab = _key(config, name, "vocab_size")
    kv_heads = int(config.get("num_key_value_heads") or heads)
    intermediate = int(config.get("intermediate_size") or config.get("n_inner") or 4 * hidden)
    tie = bool(config.get("tie_word_embeddings", False))
    params = count_params(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                          intermediate=intermediate, tie_embeddings=tie)
    return ModelSpec(name=name, params=params, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                     vocab=vocab, intermediate=intermediate, tie_embeddings=tie)


def _key(config: dict[str, Any], name: str, *keys: str) -> int:
    for key in keys:
        if config.get(key):
            return int(config[key])
    raise ValueError(f"HF config of {name!r} lacks {keys[0]!r}; need hidden_size, num_hidden_layers, "
                     "num_attention_heads and vocab_size")


def _preset(name: str, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, intermediate: int,
            tie: bool = False) -> ModelSpec:
    config = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "vocab_size": vocab, "intermediate_size": intermediate,
              "tie_word_embeddings": tie}
    return from_config_dict(config, name=name)


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
    # The runtime's CPU test models (hybridflow.models.tiny): two layers, about 0.6M weights with a
    # 1k vocabulary; plan with ModelSpec.from_hf_config(saved_dir) to use the real tokenizer's vocabulary.
    "tiny": _preset("tiny", 2, 128, 4, 2, 1024, 512, tie=True),
    "tiny-qwen2": _preset("tiny-qwen2", 2, 128, 4, 2, 1024, 512, tie=True),
    "tiny-llama": _preset("tiny-llama", 2, 128, 4, 2, 1024, 512, tie=True),
    "tiny-qwen2-wide": _preset("tiny-qwen2-wide", 2, 256, 4, 2, 1024, 1024, tie=True),
}
