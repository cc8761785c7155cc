"""The weights that leave a training engine: whole (merged, for a LoRA policy) and, with adapters, the adapters alone.

Backends differ only in how one state-dict entry becomes a whole tensor on this rank (a DTensor's all-gather, a
ZeRO-3 gather): they implement :meth:`WeightStreams.whole_state`; the naming, merging and peft formats are here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from hybridflow.backends.common import modeling, peft_lora

from hybridflow.runtime.protocols import RoleSpec


class WeightStreams:
    """``iter_full_weights``/``tied_weights`` (:class:`~hybridflow.runtime.protocols.WeightSource`) and the adapter
    methods of :class:`~hybridflow.runtime.protocols.AdapterModel` over an engine's ``model``.

    Engines set ``spec``, ``model`` and ``adapter_layers`` (:func:`peft_lora.lora_layers` of the model) and implement
    :meth:`whole_state`.
    """

    spec: RoleSpec
    model: Any
    adapter_layers: Mapping[str, peft_lora.LoraLayer]
    frozen_prefixes: tuple[str, ...] = ()  # state-dict name prefixes of weights that never train (a frozen tower)

    def whole_state(self, keep: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
        """(model state-dict name, whole tensor) of the entries ``keep`` accepts, one at a time; the tensors may be
        the live parameters (never modify them). A collective for sharded engines: every rank drains it."""
        raise NotImplementedError

    @property
    def has_adapters(self) -> bool:
        return self.spec.lora is not None

    def iter_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, whole tensor) one at a time; a LoRA policy's adapted weights merged (``W + scale * B @ A``)."""
        return peft_lora.merged_weights(self.whole_state(lambda _name: True), self.adapter_layers)

    def iter_trained_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`iter_full_weights` less the weights that never train (a frozen vision tower), which a rollout
        loaded with the model keeps: a sync sends (and a sharded engine gathers) only the rest."""
        def trained(name: str) -> bool:
            return not name.startswith(self.frozen_prefixes)

        return peft_lora.merged_weights(self.whole_state(trained), self.adapter_layers)

    def tied_weights(self) -> Mapping[str, str]:
        return peft_lora.hf_aliases(modeling.tied_weights(self.model), self.adapter_layers)

    def iter_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(peft name, whole tensor) of every adapter weight: only those are gathered on a sharded engine."""
        if not self.has_adapters:
            raise peft_lora.no_adapters(self.spec.name)
        yield from peft_lora.peft_state(self.whole_state(peft_lora.is_adapter_key), self.model).items()

    def adapter_config(self) -> dict[str, Any]:
        """peft's ``adapter_config.json`` content, naming the role's model as the base."""
        if not self.has_adapters:
            raise peft_lora.no_adapters(self.spec.name)
        return peft_lora.adapter_config(self.model, base_model=self.spec.model)

    def refuse_whole_weights(self) -> None:
        """Whole weights cannot replace a LoRA policy's (they would have to be split into base and adapters)."""
        if self.has_adapters:
            raise TypeError(f"role {self.spec.name!r} trains LoRA adapters over a frozen base: whole weights cannot "
                            "be loaded into it (load a checkpoint of its adapters instead)")
