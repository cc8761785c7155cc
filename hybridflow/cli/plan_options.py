"""`hybridflow plan`'s numbers and models, checked where the user wrote them (a flag, or a key of its
``--config`` file) before the planner's classes see them: an error names ``--batch-size`` or ``FILE: batch_size``,
never ``Workload.batch_size``. Each bound is the run's own (a step's rows, a sequence's tokens, the largest
cluster), so a plan is never made for what ``hybridflow train`` would refuse.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from hybridflow.planner import ModelSpec
from hybridflow.planner.cluster import MAX_CLUSTER_GPUS
from hybridflow.planner.execution import MAX_STALENESS, MAX_STREAM_CHUNKS
from hybridflow.planner.settings import MAX_EPOCHS, MAX_SEQUENCE_TOKENS, MAX_STEP_ROWS

# option: (lowest, highest; None: no upper bound, a budget that caps what the other bounds already bound)
INTEGER_OPTIONS: dict[str, tuple[int, int | None]] = {
    "batch_size": (1, MAX_STEP_ROWS), "n_samples": (1, MAX_STEP_ROWS), "mini_batch_size": (1, MAX_STEP_ROWS),
    "max_num_seqs": (1, MAX_STEP_ROWS), "prompt_len": (1, MAX_SEQUENCE_TOKENS),
    "response_len": (1, MAX_SEQUENCE_TOKENS), "max_response_len": (1, MAX_SEQUENCE_TOKENS),
    "image_tokens": (0, MAX_SEQUENCE_TOKENS), "template_tokens": (0, MAX_SEQUENCE_TOKENS),
    "train_tokens_per_gpu": (1, None), "forward_tokens_per_gpu": (1, None), "epochs": (1, MAX_EPOCHS),
    "max_tp": (1, MAX_CLUSTER_GPUS), "data_parallel_size": (1, MAX_CLUSTER_GPUS), "host_cores": (1, None),
    "max_staleness": (0, MAX_STALENESS), "stream_chunks": (1, MAX_STREAM_CHUNKS)}
# option: (lowest, highest, whether the lowest itself is allowed)
NUMBER_OPTIONS: dict[str, tuple[float, float, bool]] = {
    "inter_node_gbs": (0.0, math.inf, False), "gpu_memory_utilization": (0.0, 1.0, False),
    "observation_tokens": (0.0, float(MAX_SEQUENCE_TOKENS), True)}


def option_name(key: str, config: str | None, from_file: set[str]) -> str:
    """How the user wrote ``key``: ``--batch-size``, or ``FILE: batch_size`` for a key of the ``--config`` file."""
    return f"{config}: {key}" if config and key in from_file else "--" + key.replace("_", "-")


def check_numbers(settings: Mapping[str, Any], *, config: str | None, from_file: set[str]) -> None:
    """Every numeric option given is a number of its kind within its bounds; the error names it as written."""
    for key, (low, high) in INTEGER_OPTIONS.items():
        value = settings.get(key)
        if value is None:
            continue
        name = option_name(key, config, from_file)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}={value!r} must be an integer")
        if value < low or (high is not None and value > high):
            upper = f" and at most {high}" if high is not None else ""
            raise ValueError(f"{name}={value} must be at least {low}{upper}")
    for key, (least, most, closed) in NUMBER_OPTIONS.items():
        given = settings.get(key)
        if given is None:
            continue
        number = float(given) if isinstance(given, int | float) and not isinstance(given, bool) else math.nan
        if not math.isfinite(number) or not (least <= number if closed else least < number) or number > most:
            span = f"in {'[' if closed else '('}{least:g}, {most:g}]" if math.isfinite(most) else \
                f"{'>=' if closed else '>'} {least:g}"
            raise ValueError(f"{option_name(key, config, from_file)}={given!r} must be a finite number {span}")


def with_images(models: dict[str, ModelSpec], settings: Mapping[str, Any], *, config: str | None,
                from_file: set[str]) -> dict[str, ModelSpec]:
    """The role models as ``--image-tokens`` and ``--train-vision-tower`` use them: images need a role whose model
    has a vision tower, and the flag trains every tower (frozen by default)."""
    towers = [role for role, model in models.items() if model.vision is not None]
    for key in ("image_tokens", "train_vision_tower"):
        if settings.get(key) and not towers:
            raise ValueError(f"{option_name(key, config, from_file)}={settings[key]!r}: no role's model has a vision "
                             "tower; give a vision-language model, e.g. --model qwen2.5-vl-7b")
    if not settings.get("train_vision_tower"):
        return models
    return {role: replace(model, vision=model.vision.with_trainable(True)) if model.vision is not None else model
            for role, model in models.items()}


def model_spec(text: str, name: str) -> ModelSpec:
    """The model ``text`` names (a preset, a config.json path, a parameter count); ``name`` is how the user
    wrote it (``--model actor=nan``, ``FILE: models.actor=nan``), and any error starts with it."""
    try:
        return ModelSpec.parse(text)
    except (ValueError, FileNotFoundError, TypeError) as err:
        raise ValueError(f"{name}: {err}") from err
