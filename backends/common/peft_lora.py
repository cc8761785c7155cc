"""LoRA adapters (peft) on a role's model: applied once at load for every training backend, merged on the way out.

A policy with ``RoleSpec.lora`` is a ``peft`` model whose base weights are frozen: only the adapters train, sit in
the optimizer and go into checkpoints. Whole-weight consumers (a detached rollout, vLLM's in-place sync, export)
read :func:`merged_weights`: HF-named tensors, each adapted weight computed as ``W + scale * B @ A`` as it passes,
never merged into the training model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.models.vision import TOWER_MODULES, vision_tower
from hybridflow.runtime.protocols import AdapterSpec

ADAPTER = "default"  # peft's name of a model's only adapter
_PEFT_PREFIX = "base_model.model."
_BASE = ".base_layer.weight"
_PARTS = {f".lora_A.{ADAPTER}.weight": "A", f".lora_B.{ADAPTER}.weight": "B", _BASE: "W"}
_INITS: dict[str, Any] = {"default": True, "gaussian": "gaussian", "pissa": "pissa", "olora": "olora"}


@dataclass(frozen=True, kw_only=True)
class LoraLayer:
    """What merging one adapted layer needs: its scale (alpha / r) and whether its weight is stored transposed."""

    scaling: float
    fan_in_fan_out: bool


def apply_adapters(model: Any, spec: AdapterSpec, *, role: str) -> Any:
    """``model`` wrapped by peft with ``spec``'s LoRA adapters; every other parameter frozen."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise ImportError(f"role {role!r}: lora needs peft: install the `lora` extra (`pip install hybridflow[lora]`)"
                          ) from err
    check_targets(model, spec, role=role)
    targets: str | list[str] = (spec.target_modules if isinstance(spec.target_modules, str)
                                else list(spec.target_modules))
    # A vision-language model's adapters go on its language model: its vision tower's modules are excluded.
    exclude = TOWER_MODULES if vision_tower(model) is not None else None
    # peft annotates lora_alpha as int but scales by alpha / r in floats: a fractional alpha is honoured.
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha,  # type: ignore[arg-type]
                        lora_dropout=spec.dropout, target_modules=targets, exclude_modules=exclude,
                        init_lora_weights=_INITS[spec.init], task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def linear_module_paths(model: Any) -> list[str]:
    """The paths of the linear modules adapters may go on: every one of a text model's, a vision-language model's
    outside its vision tower (which takes no adapters)."""
    from transformers.pytorch_utils import Conv1D

    tower = vision_tower(model)
    inside = (tower[0] + ".") if tower is not None else None
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear | Conv1D) and name
            and not (inside is not None and (name + ".").startswith(inside))]


def linear_module_names(model: Any) -> list[str]:
    """The distinct last names of those linear modules (what ``target_modules`` may name)."""
    return sorted({name.rsplit(".", 1)[-1] for name in linear_module_paths(model)})


def check_targets(model: Any, spec: AdapterSpec, *, role: str) -> None:
    """Every named target matches a linear module of ``model`` (as a path suffix; outside a vision-language model's
    vision tower), or the error lists them."""
    if isinstance(spec.target_modules, str):
        return
    paths = linear_module_paths(model)
    unmatched = [target for target in spec.target_modules
                 if not any(path == target or path.endswith("." + target) for path in paths)]
    if unmatched:
        where = "'s language model" if vision_tower(model) is not None else ""
        raise ValueError(f"role {role!r}: lora.target_modules "
                         f"{unmatched} match no linear module of {type(model).__name__}{where}; its linear modules "
                         f"are {linear_module_names(model)} (or 'all-linear')")


def lora_layers(model: Any) -> dict[str, LoraLayer]:
    """``{module path: LoraLayer}`` of every adapted layer of a peft model (empty for any other model)."""
    try:
        from peft.tuners.lora import LoraLayer as PeftLoraLayer
    except ImportError:  # no peft: no model can carry adapters
        return {}
    return {name: LoraLayer(scaling=float(module.scaling[ADAPTER]),
                            fan_in_fan_out=bool(getattr(module, "fan_in_fan_out", False)))
            for name, module in model.named_modules() if isinstance(module, PeftLoraLayer)}


def is_adapter_key(name: str) -> bool:
    """Whether a state-dict name of a peft model is an adapter weight (``...lora_A.default.weight``)."""
    return ".lora_" in name


def hf_name(name: str) -> str:
    """The HF name of a peft model's state-dict entry (``base_model.model.`` and ``.base_layer`` dropped)."""
    return name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")


def _part(name: str, layers: Mapping[str, LoraLayer]) -> tuple[str, str] | None:
    for suffix, part in _PARTS.items():
        if name.endswith(suffix) and name[:-len(suffix)] in layers:
            return name[:-len(suffix)], part
    return None


def merged_weights(named: Iterable[tuple[str, torch.Tensor]], layers: Mapping[str, LoraLayer]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """A peft model's (name, whole tensor) stream as HF-named merged weights: ``W + scale * B @ A`` per layer.

    ``named`` must not be modified by the consumer (the live parameters of an unsharded engine): each merged
    weight is a new tensor. Holds at most one layer's base weight and adapters until the three have passed
    (a state dict lists them together). Without ``layers`` the stream passes unchanged.
    """
    if not layers:
        yield from named
        return
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        found = _part(name, layers)
        if found is None:
            yield hf_name(name), tensor
            continue
        owner, part = found
        parts = pending.setdefault(owner, {})
        parts[part] = tensor
        if len(parts) == len(_PARTS):
            del pending[owner]
            yield hf_name(owner) + ".weight", merge(parts["W"], parts["A"], parts["B"], layers[owner])
    if pending:
        raise RuntimeError(f"adapted layers {sorted(pending)[:3]} lack a base weight or an adapter in the stream")


def merge(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, layer: LoraLayer) -> torch.Tensor:
    """``W + scale * B @ A`` (transposed for fan-in-fan-out layers) in ``W``'s dtype, as peft's merge computes it.

    ``W`` (out, in), ``A`` (r, in), ``B`` (out, r).
    """
    delta = lora_b.float() @ lora_a.float()
    if layer.fan_in_fan_out:
        delta = delta.T
    return (weight.float() + delta * layer.scaling).to(weight.dtype)


def hf_aliases(aliases: Mapping[str, str], layers: Mapping[str, LoraLayer]) -> dict[str, str]:
    """A peft model's tied-weight aliases in HF names; an adapted weight is no longer the alias of anything."""
    if not layers:
        return dict(aliases)
    return {hf_name(alias): hf_name(name) for alias, name in aliases.items()
            if _part(alias, layers) is None and _part(name, layers) is None}


def peft_state(named: Iterable[tuple[str, torch.Tensor]], model: Any) -> dict[str, torch.Tensor]:
    """Adapter tensors (whole, the model's own names) renamed as peft saves them (``adapter_model.safetensors``)."""
    from peft import get_peft_model_state_dict

    return dict(get_peft_model_state_dict(model, state_dict=dict(named), adapter_name=ADAPTER))


def adapter_config(model: Any, *, base_model: str) -> dict[str, Any]:
    """peft's ``adapter_config.json`` content for ``model``'s adapters, naming ``base_model``."""
    data = model.peft_config[ADAPTER].to_dict()
    data = {key: sorted(value) if isinstance(value, set) else value for key, value in data.items()}
    data["base_model_name_or_path"] = base_model
    return data


@contextlib.contextmanager
def disabled(model: Any, *, role: str) -> Iterator[None]:
    """``model`` as its base model for the duration (peft's ``disable_adapter``)."""
    disable = getattr(model, "disable_adapter", None)
    if disable is None:
        raise ValueError(f"role {role!r} has no LoRA adapters to disable (give it a lora spec)")
    with disable():
        yield


def no_adapters(role: str) -> ValueError:
    return ValueError(f"role {role!r} trains no LoRA adapters (its spec has no lora)")


def load_adapter_state(model: Any, state: Mapping[str, torch.Tensor], *, role: str) -> None:
    """Adapter weights saved from ``model`` (its own names) loaded into it; any adapter missing is an error."""
    expected = {name for name in model.state_dict() if is_adapter_key(name)}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise KeyError(f"role {role!r}: the checkpoint's adapters do not fit this model's (missing {missing[:3]}, "
                       f"unexpected {unexpected[:3]}): were they saved with the same lora spec?")
    model.load_state_dict(dict(state), strict=False)
