"""A Python entry point in TRL's shape: ``GRPOTrainer(model, reward_funcs, args, train_dataset).train()``.

It runs the engine ``hybridflow train`` runs (:func:`~hybridflow.train.loop.train`, so
:func:`~hybridflow.train.prepare.prepare_run`): the config goes through the same loader (dotted keys, the
verl/TRL aliases, the same checks), an in-memory dataset is written once as a jsonl file named by its content
(so a resumed run reads the same file), and reward callables join the scorer as ``data.reward`` entries would.

Reward callables run in the scorer's worker processes, under ``data.reward_timeout_s``, when a fresh
interpreter can load them (a module-level function of an importable module, or a picklable callable object);
a lambda, a nested function or one defined in the ``__main__`` script runs in the training process instead,
without the deadline, with a warning naming it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hybridflow.train.config import TrainConfig, from_mapping
from hybridflow.train.config_keys import checked, flatten

Rows = Sequence[Mapping[str, Any]]
RewardInput = Callable[..., Any] | str


class GRPOTrainer:
    """Train ``model`` (a local HF directory, or a built-in tiny model name) with ``algorithm`` (default ``grpo``)
    on ``train_dataset`` (a ``datasets.Dataset`` or a list of dicts with a ``prompt`` column: text or chat
    messages, plus any columns the rewards read), scored by ``reward_funcs``: callables with TRL's signature
    ``f(prompts, completions, **kwargs) -> list[float | None]`` (or any signature ``data.reward`` accepts), or
    ``data.reward`` specs such as ``"math"``.

    ``args``: a :class:`TrainConfig`, a mapping (nested sections or dotted keys, ours or TRL's/verl's names), or
    a dataclass shaped like TRL's ``GRPOConfig`` (TRL's own included), of which the fields that differ from their
    defaults are read through the same aliases as a YAML config. ``eval_dataset`` becomes the validation set.
    """

    def __init__(self, model: str, reward_funcs: RewardInput | Sequence[RewardInput], args: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None, *, algorithm: str | None = None) -> None:
        if train_dataset is None:
            raise ValueError("GRPOTrainer needs train_dataset: a datasets.Dataset or a list of dicts with a 'prompt' "
                             "column")
        self.reward_funcs: list[RewardInput] = [reward_funcs] if callable(reward_funcs) or isinstance(
            reward_funcs, str) else list(reward_funcs)
        if not self.reward_funcs:
            raise ValueError("GRPOTrainer needs at least one reward function in reward_funcs")
        data = config_mapping(args)
        model_key = "model.path" if Path(model).is_dir() else "model.name"
        extra: dict[str, Any] = {model_key: model, "data.path": write_rows(train_dataset, "train")}
        if eval_dataset is not None:
            extra["data.val_path"] = write_rows(eval_dataset, "eval")
        if algorithm is not None:
            extra["algorithm.name"] = algorithm
        for key, value in extra.items():
            if _get(data, key) not in (None, _default(key)):
                raise ValueError(f"config key {key!r} is given by the GRPOTrainer's arguments (model, train_dataset, "
                                 "eval_dataset, algorithm); drop it from args")
            _set(data, key, value)
        self.config: TrainConfig = from_mapping(TrainConfig, _translated(data))

    def train(self, *, resume: bool = False, overwrite: bool = False) -> Any:
        """Run the config's steps (from the latest checkpoint with ``resume``); returns the
        :class:`~hybridflow.train.loop.TrainResult` (run directory, metrics, history, exported policy)."""
        from hybridflow.train.loop import train

        return train(self.config, resume=resume, overwrite=overwrite, rewards=self.reward_funcs)


def config_mapping(args: Any) -> dict[str, Any]:
    """``args`` as a config mapping (our keys, or foreign ones the loader translates)."""
    if args is None:
        return {}
    if isinstance(args, TrainConfig):
        return _nested(dataclasses.asdict(args))
    if isinstance(args, Mapping):
        return _nested(dict(args))
    if dataclasses.is_dataclass(args) and not isinstance(args, type):
        return _changed_fields(args)
    raise TypeError(f"GRPOTrainer args is a {type(args).__name__}: give a TrainConfig, a mapping of config keys, or a "
                    "GRPOConfig-shaped dataclass")


def _changed_fields(args: Any) -> dict[str, Any]:
    """The fields of a GRPOConfig-shaped dataclass that differ from a default instance (what the user set; TRL's
    ``__post_init__`` derives several, which a default instance derives alike), translated to our keys."""
    baseline = _baseline(args)
    changed: dict[str, Any] = {}
    for spec in dataclasses.fields(args):
        value = getattr(args, spec.name)
        default = getattr(baseline, spec.name) if baseline is not None else (
            spec.default if spec.default is not dataclasses.MISSING else dataclasses.MISSING)
        if value != default or (spec.name in TRL_DEFAULTS_KEPT and hasattr(args, "lr_scheduler_type")):
            changed[spec.name] = value
    return _translated(changed)


# TRL's defaults that shape the update and differ from ours: a GRPOConfig that leaves them unset trains with
# them in TRL (a learning rate of 1e-6 decaying linearly to 0 over max_steps), so a ported one does here too.
# Issue 24: without the linear decay a ported script's policy moved ~2x further from its reference per step
# (benchmarks/trl_kl_parity.py, docs/benchmarks.md "vs TRL: the KL gap").
TRL_DEFAULTS_KEPT = ("learning_rate", "lr_scheduler_type", "max_grad_norm")


def _baseline(args: Any) -> Any:
    """A default instance of ``args``'s class, or None when one cannot be built. transformers' TrainingArguments
    (so TRL's GRPOConfig) refuses its own defaults (bf16) on a machine without a GPU unless ``use_cpu`` is set:
    the baseline then takes the given ``use_cpu``, so derived fields (accelerator_config...) compare alike."""
    for kwargs in ({}, {"use_cpu": getattr(args, "use_cpu", None)}):
        if kwargs and kwargs["use_cpu"] is None:
            break
        try:
            return type(args)(**kwargs)
        except (TypeError, ValueError):  # a required field: compare with the declared defaults instead
            continue
    return None


def _translated(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with TRL's and verl's keys translated (every bad key named in one error), nested again."""
    return checked(TrainConfig, flatten(TrainConfig, data))


def write_rows(dataset: Any, name: str) -> str:
    """``dataset``'s rows as a jsonl file named by their content (the same rows: the same path, so a resumed run's
    config is unchanged); the file lives in the system's temporary directory."""
    rows = _rows(dataset, name)
    try:
        text = "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)
    except TypeError as err:
        raise TypeError(f"GRPOTrainer {name}_dataset: a row holds a value JSON cannot write ({err}); keep the columns "
                        "to text, numbers, lists and mappings") from err
    folder = Path(tempfile.gettempdir()) / "hybridflow-datasets"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.jsonl"
    if not path.is_file():
        partial = path.with_suffix(f".{id(rows)}.tmp")
        partial.write_text(text)
        partial.replace(path)  # atomic: a concurrent run writing the same rows sees a whole file
    return str(path)


def _rows(dataset: Any, name: str) -> list[dict[str, Any]]:
    if hasattr(dataset, "to_list") and callable(dataset.to_list):  # datasets.Dataset
        rows = dataset.to_list()
    elif isinstance(dataset, Iterable) and not isinstance(dataset, str | bytes | Mapping):
        rows = list(dataset)
    else:
        raise TypeError(f"GRPOTrainer {name}_dataset is a {type(dataset).__name__}: give a datasets.Dataset or a list "
                        "of dicts")
    if not rows:
        raise ValueError(f"GRPOTrainer {name}_dataset has no rows")
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TypeError(f"GRPOTrainer {name}_dataset row {i} is a {type(row).__name__}, not a dict of columns")
    return [dict(row) for row in rows]


def _nested(data: dict[str, Any]) -> dict[str, Any]:
    """A mapping whose dotted keys (``{"optim.actor.lr": 1e-4}``) become sections, so either form can be given."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        target = out
        *parents, last = key.split(".")
        for part in parents:
            target = target.setdefault(part, {})
        target[last] = value
    return out


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    data[last] = value


def _default(dotted: str) -> Any:
    """The default value of one of our dotted keys (a TrainConfig given whole carries every default)."""
    return _get(dataclasses.asdict(TrainConfig()), dotted)


def _get(data: Mapping[str, Any], dotted: str) -> Any:
    value: Any = data
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


__all__ = ["GRPOTrainer", "config_mapping", "write_rows"]
