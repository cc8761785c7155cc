"""Tiny Hugging Face model configs by name, built offline for tests, demos and benchmarks; their character
tokenizer and the loader of a model's saved tokenizer are in :mod:`hybridflow.models.tokenizer`, a tiny Qwen2-VL and
its processor in :mod:`hybridflow.models.vision`."""

from hybridflow.models.tiny import TINY_CONFIGS, build_tiny_causal_lm, save_model_dir, tiny_config

__all__ = ["TINY_CONFIGS", "build_tiny_causal_lm", "save_model_dir", "tiny_config"]
