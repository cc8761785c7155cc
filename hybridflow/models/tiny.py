"""Tiny Qwen2 / Llama configurations (~0.5M parameters) that train in seconds on a CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Sizes follow shared/notes/cpu-stack.md: 2 layers of width 128 train a 16x64 step in < 0.1 s.
_COMMON: dict[str, Any] = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                               tie_word_embeddings=True)
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-qwen2": ("qwen2", _COMMON),
    "tiny-llama": ("llama", _COMMON),
    "tiny-qwen2-wide": ("qwen2", {**_COMMON, "hidden_size": 256, "intermediate_size": 1024}),
}


def tiny_config(name: str, *, vocab_size: int, pad_token_id: int = 0, bos_token_id: int = 1,
                eos_token_id: int = 2) -> Any:
    """The HF config of a built-in tiny model; dropout is off so runs are reproducible."""
    from transformers import AutoConfig

    if name not in TINY_CONFIGS:
        raise KeyError(f"unknown tiny model {name!r}; built-in names: {sorted(TINY_CONFIGS)}")
    model_type, sizes = TINY_CONFIGS[name]
    return AutoConfig.for_model(model_type, vocab_size=vocab_size, pad_token_id=pad_token_id,
                                bos_token_id=bos_token_id, eos_token_id=eos_token_id, attention_dropout=0.0,
                                **sizes)


def build_tiny_causal_lm(name: str, *, vocab_size: int, seed: int = 0, **token_ids: int) -> Any:
    """A randomly initialised causal LM of the named tiny config (seeded, fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(name, vocab_size=vocab_size, **token_ids))


def save_model_dir(model: Any, tokenizer: Any, directory: str | Path) -> Path:
    """Save model and tokenizer side by side, so a role loads both from one local path."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
