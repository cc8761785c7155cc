"""A LoRA run's checkpoint as a peft adapter directory and, on request, the merged HF model (``hybridflow export``).

A LoRA checkpoint holds only the adapters (``...lora_A.default.weight`` in the trainer's peft names); their
settings (``roles.<role>.lora``) and the base model come from the run's ``config.json``. The adapter directory
(``adapter_model.safetensors`` + ``adapter_config.json`` naming the base) is written from the checkpoint alone;
the merged model needs the base weights and merges with peft's own ``merge_and_unload``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hybridflow.models.vision import TOWER_MODULES, is_vision_language
from hybridflow.runtime.protocols import AdapterSpec
from hybridflow.train.export import EXPORT_MARKER, model_class, write_dir_atomically

ADAPTER = "default"  # peft's name of a model's only adapter (backends/common/peft_lora.py ADAPTER)
_INITS: dict[str, Any] = {"default": True, "gaussian": "gaussian", "pissa": "pissa", "olora": "olora"}


def is_adapter_state(state: Mapping[str, torch.Tensor]) -> bool:
    """Whether a checkpoint's weights are LoRA adapters alone (what a LoRA run checkpoints)."""
    return bool(state) and all(".lora_" in name for name in state)


def run_lora(run_config: Mapping[str, Any] | None, role: str) -> AdapterSpec | None:
    """``roles.<role>.lora`` of a run's ``config.json`` as an :class:`AdapterSpec` (None: full fine-tuning)."""
    entry = ((run_config or {}).get("roles") or {}).get(role) or {}
    raw = entry.get("lora") if isinstance(entry, Mapping) else None
    return AdapterSpec(**raw) if raw else None


def peft_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Trainer adapter names (``...q_proj.lora_A.default.weight``) as peft saves them (``...q_proj.lora_A.weight``)."""
    return {name.replace(f".{ADAPTER}.", "."): tensor.detach().contiguous() for name, tensor in state.items()}


def adapted_modules(state: Mapping[str, torch.Tensor]) -> list[str]:
    """The last names of the adapted modules (``q_proj``, ...): what ``all-linear`` resolved to in the trainer."""
    return sorted({name.split(".lora_", 1)[0].rsplit(".", 1)[-1] for name in state})


def lora_config(spec: AdapterSpec, *, target_modules: list[str], base_model: str, vision: bool = False) -> Any:
    """peft's ``LoraConfig`` for ``spec`` (as the trainers build it) naming ``base_model``; ``vision``: the base is a
    vision-language model, whose vision tower the adapters leave out (``exclude_modules``, as the trainers do)."""
    try:
        from peft import LoraConfig
    except ImportError as err:
        raise ImportError("exporting LoRA adapters needs peft: install the `lora` extra (`pip install "
                          "hybridflow[lora]`)") from err
    # peft annotates lora_alpha as int but scales by alpha / r in floats: a fractional alpha is honoured.
    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha,  # type: ignore[arg-type]
                      lora_dropout=spec.dropout, target_modules=target_modules,
                      init_lora_weights=_INITS[spec.init], task_type="CAUSAL_LM",
                      exclude_modules=TOWER_MODULES if vision else None, base_model_name_or_path=base_model)


def is_vision_base(base_model: str | Path) -> bool:
    """Whether ``base_model`` is a vision-language model's directory (False when it is not there: an adapter export
    then names the adapted modules as the trainer's state does)."""
    from transformers import AutoConfig

    return (Path(base_model) / "config.json").is_file() and is_vision_language(AutoConfig.from_pretrained(base_model))


def save_adapter_dir(state: Mapping[str, torch.Tensor], spec: AdapterSpec, base_model: str | Path, out: str | Path,
                     *, role: str = "actor") -> Path:
    """The adapters of ``state`` as a peft directory at ``out`` (atomically), loadable with
    ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model), out)``."""
    from safetensors.torch import save_file

    if not spec.keeps_base:
        raise ValueError(f"roles.{role}.lora.init={spec.init!r} moves part of each base weight into the adapter at "
                         "load: the adapter does not apply to the base model directory. Export the merged model "
                         "(--merged) instead")
    targets = list(spec.target_modules) if isinstance(spec.target_modules, tuple) else adapted_modules(state)
    config = lora_config(spec, target_modules=targets, base_model=str(base_model), vision=is_vision_base(base_model))

    def write(tmp: Path) -> None:
        save_file(peft_names(state), str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(str(tmp))
        (tmp / EXPORT_MARKER).write_text(json.dumps({"kind": "lora_adapter"}))

    return write_dir_atomically(Path(out), write)


def merged_state(state: Mapping[str, torch.Tensor], spec: AdapterSpec, base_model: str | Path, *, seed: int,
                 role: str = "actor") -> dict[str, torch.Tensor]:
    """The base model with ``state``'s adapters merged (``W + alpha / r * B @ A``, peft's ``merge_and_unload``).

    The adapters are rebuilt as the trainer built them (seeded like its load), so ``pissa``/``olora``, whose init
    moves part of each base weight into the adapter, recover the same residual base before the merge.
    """
    from peft import get_peft_model
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base_model)
    base = model_class(config).from_pretrained(base_model, dtype=torch.float32)
    targets = list(spec.target_modules) if isinstance(spec.target_modules, tuple) else adapted_modules(state)
    torch.manual_seed(seed)  # backends/common/modeling.load_model seeds the same way before adapting
    model = get_peft_model(base, lora_config(spec, target_modules=targets, base_model=str(base_model),
                                             vision=is_vision_language(config)))
    expected = {name for name in model.state_dict() if ".lora_" in name}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise KeyError(f"the checkpoint's adapters do not fit {base_model} with roles.{role}.lora={spec} (missing "
                       f"{missing[:3]}, unexpected {unexpected[:3]}): is it the run's base model?")
    model.load_state_dict(dict(state), strict=False)
    return dict(model.merge_and_unload().state_dict())
