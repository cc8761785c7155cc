"""The trained policy as a Hugging Face directory: safetensors weights, config, tokenizer, generation config.

A run writes one at its end (``RUN_DIR/final``) and one beside each checkpoint's role states
(``checkpoints/step_N/hf``); ``hybridflow export`` converts a checkpoint written by any backend (torch
``state.pt``, FSDP's DCP shards, DeepSpeed's ZeRO files) without starting workers. The result loads
with ``AutoModelForCausalLM.from_pretrained`` and ``vllm.LLM(model=...)``; a vision-language policy's with
``AutoModelForImageTextToText.from_pretrained``, beside its processor's files (image processor, tokenizer, chat
template: :func:`hybridflow.models.vision.save_processor`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from hybridflow.graph import Graph, RoleKind
from hybridflow.models.vision import is_vision_language, load_processor, save_processor
from hybridflow.runtime.weights import DTYPES, state_from_wire

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EXPORT_MARKER = "hybridflow_export.json"  # written into every export: what marks a directory safe to replace


def policy_role(graph: Graph) -> str:
    """The trainable policy whose weights a run exports (the graph's only POLICY role)."""
    policies = [role.name for role in graph.roles if role.kind is RoleKind.POLICY]
    if len(policies) != 1:
        raise ValueError(f"the {graph.name} graph has policies {policies}; export needs exactly one")
    return policies[0]


def controller_state(controller: Any, role: str) -> dict[str, torch.Tensor]:
    """``role``'s whole weights in fp32, gathered by its worker group (FSDP / ZeRO-3 shards included).

    ``export_weights`` returns the packed weights on the local and torchrun executors and a Ray object
    reference under Ray; tied copies come back as names and point at their tensor again here.
    """
    index = controller.plan.group_index(role)
    if index is None:
        raise ValueError(f"role {role!r} runs on the driver; it has no weights to export")
    exported = controller.groups[index].export_weights(role, "fp32")
    if not isinstance(exported, tuple):
        import ray

        exported = ray.get(exported)
    wire, aliases = exported
    state = state_from_wire(wire)
    state.update({alias: state[name] for alias, name in aliases.items()})
    return state


def save_hf_dir(state: Mapping[str, torch.Tensor], base_model: str | Path, tokenizer: Any, out: str | Path, *,
                dtype: str | None = None) -> Path:
    """Write ``state`` as an HF model directory at ``out`` (atomically: a temp dir renamed into place).

    ``base_model``: the run's starting directory, whose config (architecture, sizes) the weights fit; a
    vision-language model's processor is copied from it (``tokenizer`` is then the processor's).
    ``dtype``: ``fp32``/``bf16``/``fp16``; default the base config's dtype (fp32 when it names none).
    """
    from transformers import AutoConfig

    out = Path(out)
    config = AutoConfig.from_pretrained(base_model)
    chosen = EXPORT_DTYPES[dtype] if dtype else _config_dtype(config)
    model = model_class(config).from_config(config, dtype=torch.float32)
    processor = load_processor(base_model) if is_vision_language(config) else None
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), sorted(set(state) - expected)
    tied = {name for name in missing if _is_tied(model, name)}
    if unexpected or missing - tied:
        raise ValueError(f"the weights do not fit {base_model}'s {type(model).__name__}: missing "
                         f"{sorted(missing - tied)[:5]}, unexpected {unexpected[:5]}")
    model.load_state_dict(dict(state), strict=False)
    model.to(chosen)
    model.config.use_cache = True  # training turns it off; inference engines want it

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        if processor is not None:
            save_processor(processor, tmp)
        elif tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _write_generation_config(model, base_model, tokenizer, tmp)
        (tmp / EXPORT_MARKER).write_text(json.dumps({"base_model": str(base_model),
                                                                "dtype": str(chosen).removeprefix("torch.")}))

    return write_dir_atomically(out, write)


def model_class(config: Any) -> Any:
    """The transformers auto class a policy's weights load into: image-text-to-text for a vision-language model
    (no causal-LM class takes its images), causal LM otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


class ExportTargetError(ValueError):
    """An export's output directory would lose something hybridflow did not write there."""


def is_previous_export(path: Path) -> bool:
    """Whether ``path`` is a directory an export wrote (its :data:`EXPORT_MARKER` is there)."""
    return (path / EXPORT_MARKER).is_file()


def check_export_target(out: Path, checkpoint: Path, *, overwrite: bool) -> None:
    """Refuse an ``out`` whose writing would delete what the export did not write.

    ``out`` must be absent, an empty directory, or (with ``overwrite``) a previous export; it may not be
    ``checkpoint``, hold it, or lie inside the checkpoints folder of ``checkpoint``'s run.
    """
    target, source = out.resolve(), checkpoint.resolve()
    shelf = source.parent if source.parent.name == "checkpoints" else source
    if target == source or source.is_relative_to(target):
        raise ExportTargetError(f"OUT {str(out)!r} holds the checkpoint being exported ({source}); writing it would "
                                "delete the checkpoint: choose a directory outside the run")
    if target.is_relative_to(shelf):
        raise ExportTargetError(f"OUT {str(out)!r} lies inside the run's checkpoints ({shelf}), which the run "
                                "manages: choose a directory outside them")
    if target.exists() and not target.is_dir():
        raise ExportTargetError(f"OUT {str(out)!r} is a file, not a directory: choose another path")
    if not target.is_dir() or not any(target.iterdir()):
        return
    if not is_previous_export(target):
        raise ExportTargetError(f"OUT {str(out)!r} already holds files an export did not write (no {EXPORT_MARKER}): "
                                "choose an absent or empty directory")
    if not overwrite:
        raise ExportTargetError(f"OUT {str(out)!r} holds a previous export: pass --overwrite to replace it, or "
                                "choose another directory")


def write_dir_atomically(out: Path, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` into a temporary directory beside ``out``, then renamed into place: a failed export
    leaves no half-written directory. An ``out`` already there is replaced only if an export wrote it (or
    it is empty); anything else is refused before any writing, so nothing a user put there is deleted."""
    if out.exists() and not (out.is_dir() and (is_previous_export(out) or not any(out.iterdir()))):
        raise ExportTargetError(f"{str(out)!r} exists and was not written by an export (no {EXPORT_MARKER}); "
                                "refusing to replace it: choose an absent or empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def export_policy(controller: Any, graph: Graph, base_model: str | Path, tokenizer: Any, out: str | Path, *,
                  dtype: str | None = None) -> Path:
    """The running policy's current weights as an HF directory at ``out``."""
    return save_hf_dir(controller_state(controller, policy_role(graph)), base_model, tokenizer, out, dtype=dtype)


def _config_dtype(config: Any) -> torch.dtype:
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(named, torch.dtype):
        return named
    if isinstance(named, str) and named in {"float32", "bfloat16", "float16"}:
        found: torch.dtype = getattr(torch, named)
        return found
    return DTYPES["fp32"]


def _is_tied(model: Any, name: str) -> bool:
    # lm_head.weight of a model with tied embeddings is the embedding matrix; HF ties it again on load.
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return bool(getattr(model.config, "tie_word_embeddings", False)) and name in tied


def _write_generation_config(model: Any, base_model: str | Path, tokenizer: Any, out: Path) -> None:
    """The base model's generation config (sampling defaults), with the tokenizer's special token ids."""
    from transformers import GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(base_model)
    except OSError:  # the base directory has none: derive one from the model config
        generation = GenerationConfig.from_model_config(model.config)
    if tokenizer is not None:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(tokenizer, key, None)
            if value is not None:
                setattr(generation, key, value)
    generation.save_pretrained(out)
