"""LoRA adapters as the planner costs them: trainable parameters from a model's shape, and how they travel.

A LoRA adapter of rank ``r`` on a linear layer ``d_in -> d_out`` adds ``A (r x d_in)`` and ``B (d_out x r)``:
``r·(d_in + d_out)`` trainable weights, while the layer's own weights stay frozen. Per decoder layer the
linear layers are the attention's ``q_proj`` (``h -> heads·d``), ``k_proj`` and ``v_proj`` (``h -> kv_heads·d``:
grouped-query attention makes them narrow), ``o_proj`` (``heads·d -> h``) and the gated MLP's ``gate_proj``,
``up_proj`` (``h -> I``) and ``down_proj`` (``I -> h``). ``all-linear`` (peft's default here) targets every one
of them but the output head (``lm_head``); embeddings and norms are never targeted. Mixture-of-experts layers
count ``gate_proj``/``up_proj``/``down_proj`` once per routed expert (width ``moe_intermediate_size``) plus the
router (``h -> experts``), as peft adapts per-expert linear modules; multi-head latent attention is counted as
plain attention of ``heads x head_dim``: an estimate for those models, exact for dense decoders.

Torch-free: this is arithmetic on a :class:`~hybridflow.planner.models.ModelSpec`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridflow.planner.models import ModelSpec

ALL_LINEAR = "all-linear"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
ROUTER_MODULE = "gate"  # an MoE layer's router (Qwen-MoE ``mlp.gate``)
LINEAR_MODULES = (*ATTENTION_MODULES, *MLP_MODULES)
# Engines that take an adapter as is (versioned in-memory LoRA requests): the base is loaded once and only
# adapter bytes travel per update. Every other engine receives the merged weights (base + B·A) in full.
ADAPTER_SYNC_ENGINES = frozenset({"vllm"})
SYNC_MODES = ("adapter", "merged")
KEEPS_BASE_INITS = ("default", "gaussian")  # peft inits that leave the base weights as the model dir has them


@dataclass(frozen=True, kw_only=True)
class LoraPlan:
    """A LoRA adapter on a role's model, as the planner costs it (peft's ``LoraConfig`` fields that matter).

    ``rank``: ``r``. ``target_modules``: ``"all-linear"`` or names from :data:`LINEAR_MODULES` (``("q_proj",
    "v_proj")``). ``dropout``: peft's ``lora_dropout``; above 0 each targeted layer keeps its dropped-out input
    for the backward pass (more activation memory, costed). ``sync``: how the rollout engine takes an update:
    ``"adapter"`` (only the adapter's bytes; vLLM), ``"merged"`` (the merged full weights; engines without LoRA)
    or None (the engine's: vLLM on GPUs, the native rollout on CPU, as a dry run assumes). ``alpha`` and
    ``init`` change learning, not cost, and are not held here.
    """

    rank: int
    target_modules: str | tuple[str, ...] = ALL_LINEAR
    dropout: float = 0.0
    sync: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraPlan.rank={self.rank!r} must be a positive integer (the adapter rank, e.g. 16)")
        targets = self.target_modules
        if isinstance(targets, str) and targets != ALL_LINEAR:
            targets = tuple(name.strip() for name in targets.replace("+", ",").split(",") if name.strip())
        if not isinstance(targets, str):
            targets = tuple(targets)
            unknown = sorted(set(targets) - set(LINEAR_MODULES) - {ROUTER_MODULE})
            if unknown or not targets:
                raise ValueError(f"LoraPlan.target_modules={list(targets)!r}: unknown {unknown}; give "
                                 f"'{ALL_LINEAR}' or names from {list(LINEAR_MODULES)}")
            targets = tuple(dict.fromkeys(targets))
        object.__setattr__(self, "target_modules", targets)
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, int | float) or not 0 <= self.dropout < 1:
            raise ValueError(f"LoraPlan.dropout={self.dropout!r} must be in [0, 1) (peft lora_dropout)")
        if self.sync is not None and self.sync not in SYNC_MODES:
            raise ValueError(f"LoraPlan.sync={self.sync!r} must be one of {list(SYNC_MODES)} or None (the "
                             "engine's: adapter-only for vLLM, merged weights otherwise)")

    def targets(self, model: ModelSpec) -> tuple[str, ...]:
        """The linear layers this adapter trains in each decoder layer of ``model``."""
        if self.target_modules == ALL_LINEAR:
            return (*LINEAR_MODULES, ROUTER_MODULE) if model.is_moe else LINEAR_MODULES
        return tuple(self.target_modules)

    def trainable_params(self, model: ModelSpec) -> int:
        """The adapter's weights on ``model``: ``Σ_layers Σ_targeted r·(d_in + d_out)``."""
        shapes = linear_shapes(model)
        return model.layers * sum(count * self.rank * (d_in + d_out)
                                  for name in self.targets(model) if name in shapes
                                  for d_in, d_out, count in (shapes[name],))

    def saved_inputs_per_token(self, model: ModelSpec) -> int:
        """Elements per token and layer the backward pass keeps beyond the frozen model's activations: each
        targeted layer's ``r``-wide ``x·Aᵀ``, and with dropout its dropped-out input (``d_in``; without dropout
        ``A`` reads the input the frozen layer already keeps)."""
        shapes = linear_shapes(model)
        total = 0
        for name in self.targets(model):
            if name in shapes:
                d_in, _, count = shapes[name]
                total += count * (self.rank + (d_in if self.dropout > 0 else 0))
        return total

    def describe(self) -> str:
        targets = self.target_modules if isinstance(self.target_modules, str) else "+".join(self.target_modules)
        return f"LoRA rank {self.rank} ({targets})"

    @classmethod
    def parse(cls, text: str) -> LoraPlan:
        """``rank=16[,targets=all-linear|q_proj+v_proj][,dropout=0.05][,sync=adapter|merged]`` (CLI ``--lora``)."""
        values: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = (piece.strip() for piece in item.partition("="))
            if not sep or not value:
                raise ValueError(f"--lora {text!r}: {item!r} must be KEY=VALUE, e.g. rank=16,targets=q_proj+v_proj")
            values[key] = value
        return cls.from_mapping(values, where="--lora")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | Any, *, where: str = "lora") -> LoraPlan:
        """From a train config's ``roles.<name>.lora`` (a mapping, or a record with those attributes): ``rank``,
        ``target_modules`` (or ``targets``), ``dropout``, ``sync``; ``alpha`` and ``init`` are accepted and
        ignored (they change learning, not cost). Errors name ``where`` and the key."""
        if isinstance(data, LoraPlan):
            return data
        if not isinstance(data, Mapping):
            data = {key: getattr(data, key) for key in (*_KEYS, "targets") if getattr(data, key, None) is not None}
        unknown = sorted(set(data) - set(_KEYS) - {"targets"})
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; known: {sorted(_KEYS)}")
        if "rank" not in data:
            raise ValueError(f"{where}: 'rank' is missing (the adapter rank, e.g. rank=16)")
        raw = data["rank"]
        try:
            rank = raw if isinstance(raw, int) else int(str(raw).strip())
            dropout = float(data.get("dropout") or 0.0)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: rank={raw!r} must be a positive integer and dropout={data.get('dropout')!r} "
                             "a number in [0, 1)") from err
        targets = data.get("target_modules", data.get("targets", ALL_LINEAR))
        if isinstance(targets, list | tuple):
            targets = tuple(str(name) for name in targets)
        try:
            return cls(rank=rank, target_modules=targets, dropout=dropout, sync=data.get("sync"))
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err


_KEYS = ("rank", "target_modules", "dropout", "sync", "alpha", "init")


def linear_shapes(model: ModelSpec) -> dict[str, tuple[int, int, int]]:
    """Per decoder layer: linear layer name -> (d_in, d_out, how many of it)."""
    h, width, kv_width = model.hidden, model.heads * model.head_dim, model.kv_heads * model.head_dim
    shapes = {"q_proj": (h, width, 1), "k_proj": (h, kv_width, 1), "v_proj": (h, kv_width, 1),
              "o_proj": (width, h, 1)}
    if model.is_moe:
        expert_width = model.expert_params // (model.layers * model.experts * 3 * h)
        shapes.update({"gate_proj": (h, expert_width, model.experts), "up_proj": (h, expert_width, model.experts),
                       "down_proj": (expert_width, h, model.experts), ROUTER_MODULE: (h, model.experts, 1)})
    elif model.intermediate:
        shapes.update({"gate_proj": (h, model.intermediate, 1), "up_proj": (h, model.intermediate, 1),
                       "down_proj": (model.intermediate, h, 1)})
    return shapes


def sync_mode(plan: LoraPlan, engine: str) -> str:
    """``plan.sync`` if set, else what ``engine`` takes: adapter-only for :data:`ADAPTER_SYNC_ENGINES`."""
    if plan.sync is not None:
        return plan.sync
    return "adapter" if engine in ADAPTER_SYNC_ENGINES else "merged"


def adapter_sync_refusal(*, init: str, target_modules: str | tuple[str, ...],
                         sleep_level: int = 0) -> str | None:
    """Why a LoRA adapter cannot reach vLLM alone (None: it can), so the update travels merged instead.

    vLLM loads the base from the model dir once: an init that rewrites the base (``pissa``, ``olora``) or a
    level-2 sleep (which discards the base, never resent by an adapter sync) breaks that; vLLM's LoRA layers
    adapt the decoder's linear modules (:data:`LINEAR_MODULES`) only.
    """
    where = "lora"  # the adapter spec's fields
    if init not in KEEPS_BASE_INITS:
        return (f"{where}.init={init!r} rewrites the base weights at load, so vLLM's base model (loaded from the "
                "model dir) is not the adapters' base")
    if not isinstance(target_modules, str):
        unsupported = sorted(set(target_modules) - set(LINEAR_MODULES))
        if unsupported:
            return (f"{where}.target_modules {unsupported} are not modules vLLM's LoRA layers adapt "
                    f"({list(LINEAR_MODULES)})")
    if sleep_level == 2:
        return ("rollout_options.sleep_level=2 discards vLLM's base weights, which an adapter-only sync never "
                "resends (use sleep_level 1)")
    return None
