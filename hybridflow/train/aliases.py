"""verl and TRL names in a config: the same meaning under another name is renamed; a different one is refused.

A config written with verl's or TRL's names (``actor_rollout_ref.rollout.n``, ``num_generations``,
``max_response_length``...) either maps onto our key (same meaning: renamed, the value kept) or is refused
with what to write instead (different meaning: ``ppo_mini_batch_size`` is rows per mini-batch, ours is a
count; ``kl_loss_coef`` is a loss term, our ``kl_coef`` is one only in some algorithms). docs/migrating.md
has the table side by side.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class ForeignKey:
    """A verl/TRL key: ``target`` when it means exactly our key, else ``advice`` on what to write."""

    source: str
    target: str | None = None
    advice: str = ""

    @property
    def nested(self) -> bool:
        """verl's keys live in sections (``actor_rollout_ref.actor.*``) and match at any depth; TRL's are
        top-level fields of its config and match only there (``actor.learning_rate`` is just a typo)."""
        return self.source == "verl"


def _same(source: str, target: str) -> ForeignKey:
    return ForeignKey(source=source, target=target)


# verl's are recognised by their last dotted parts (``actor_rollout_ref.rollout.n`` ends with ``rollout.n``).
FOREIGN: dict[str, ForeignKey] = {
    "rollout.n": _same("verl", "algorithm_options.n"),
    "num_generations": _same("TRL", "algorithm_options.n"),
    "max_response_length": _same("verl", "algorithm_options.max_new_tokens"),
    "max_completion_length": _same("TRL", "algorithm_options.max_new_tokens"),
    "rollout.temperature": _same("verl", "algorithm_options.temperature"),
    "temperature": _same("TRL", "algorithm_options.temperature"),
    "rollout.top_p": _same("verl", "algorithm_options.top_p"),
    "top_p": _same("TRL", "algorithm_options.top_p"),
    "rollout.top_k": _same("verl", "algorithm_options.top_k"),
    "top_k": _same("TRL", "algorithm_options.top_k"),
    "train_batch_size": _same("verl", "data.batch_size"),  # prompts per step in both
    "actor.optim.lr": _same("verl", "actor.lr"),
    "learning_rate": _same("TRL", "actor.lr"),
    "ppo_epochs": _same("verl", "actor.epochs"),
    "num_iterations": _same("TRL", "actor.epochs"),
    "clip_ratio_high": _same("verl", "algorithm_options.clip_ratio_high"),
    "loss_agg_mode": _same("verl", "algorithm_options.loss_agg"),
    "entropy_coeff": _same("verl", "algorithm_options.entropy_coef"),
    "total_training_steps": _same("verl", "steps"),
    "max_steps": _same("TRL", "steps"),
    "test_freq": _same("verl", "validation_every"),
    "eval_steps": _same("TRL", "validation_every"),
    "save_freq": _same("verl", "checkpoint_every"),
    "save_steps": _same("TRL", "checkpoint_every"),
    "max_actor_ckpt_to_keep": _same("verl", "keep_checkpoints"),
    "save_total_limit": _same("TRL", "keep_checkpoints"),
    "ppo_mini_batch_size": ForeignKey(source="verl", advice=(
        "verl's ppo_mini_batch_size counts prompts per mini-batch; here actor.mini_batches is how many "
        "mini-batches a step's batch is cut into: set actor.mini_batches = data.batch_size / ppo_mini_batch_size")),
    "kl_loss_coef": ForeignKey(source="verl", advice=(
        "verl's kl_loss_coef weighs a KL term in the actor loss (use_kl_loss: true); here that is "
        "algorithm_options.kl_coef for grpo, dr_grpo, gspo and reinforce_pp (a loss term), while ppo, rloo "
        "and remax use algorithm_options.kl_coef as a reward penalty (verl's algorithm.kl_ctrl.kl_coef)")),
    "beta": ForeignKey(source="TRL", advice=(
        "TRL's beta is the KL coefficient: here algorithm_options.kl_coef (a loss term in grpo, as in TRL)")),
    "train_files": ForeignKey(source="verl", advice="verl's data.train_files is data.path here (one file or "
                                                    "a datasets directory)"),
    "val_files": ForeignKey(source="verl", advice="verl's data.val_files is data.val_path here (one file)"),
}

FREE_FORM = ("algorithm_options", "meshes", "roles")  # sections whose keys are not ours to judge here


def translate_foreign_keys(data: Mapping[str, Any], known: Callable[[str], bool]) -> dict[str, Any]:
    """``data`` with verl/TRL keys renamed to ours; a key whose meaning differs raises, saying what to write.

    ``known(dotted_key)`` tells whether a key is already ours (those are never touched).
    """
    out = _copy(data)
    for key, value in _flatten(data):
        if known(key) or key.split(".")[0] in FREE_FORM:
            continue
        name = next((n for n, f in FOREIGN.items() if key == n or (f.nested and key.endswith("." + n))), None)
        if name is None:
            continue
        foreign = FOREIGN[name]
        if foreign.target is None:
            raise KeyError(f"config key {key!r} is a {foreign.source} name: {foreign.advice} (docs/migrating.md)")
        if _get(out, foreign.target) is not None:
            raise KeyError(f"config keys {key!r} ({foreign.source}) and {foreign.target!r} are the same setting; "
                           f"keep {foreign.target!r}")
        _delete(out, key.split("."))
        _set(out, foreign.target.split("."), value)
    return out


def check_algorithm_options(factory: Any, options: Mapping[str, Any], algorithm: str) -> None:
    """Options the graph factory does not take are refused naming the key (a foreign name with its advice),
    instead of the factory's raw ``TypeError``."""
    if not callable(factory):
        return
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check against
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    for key in options:
        if key in parameters:
            continue
        foreign = FOREIGN.get(key)
        hint = ""
        if foreign is not None:
            hint = f" ({foreign.source} name: {foreign.advice or 'write ' + repr(foreign.target)})"
        raise KeyError(f"config key 'algorithm_options.{key}': {algorithm} takes no option {key!r}{hint}; "
                       f"its options are {sorted(parameters)}")


def _flatten(data: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for key, value in data.items():
        if isinstance(value, Mapping) and value and str(key) not in FREE_FORM:
            items += _flatten(value, f"{prefix}{key}.")
        else:
            items.append((f"{prefix}{key}", value))
    return items


def _copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {key: _copy(value) if isinstance(value, Mapping) else value for key, value in data.items()}


def _get(data: Mapping[str, Any], dotted: str) -> Any:
    node: Any = data
    for key in dotted.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def _set(data: dict[str, Any], keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        data = data.setdefault(key, {})
    data[keys[-1]] = value


def _delete(data: dict[str, Any], keys: list[str]) -> None:
    """Remove ``keys`` and the sections it leaves empty (``actor_rollout_ref.rollout`` after its ``n``)."""
    parents = [data]
    for key in keys[:-1]:
        parents.append(parents[-1][key])
    parents[-1].pop(keys[-1])
    for depth in range(len(keys) - 1, 0, -1):
        if not parents[depth]:
            parents[depth - 1].pop(keys[depth - 1])
