"""Driver-side scorers: decode samples, apply weighted reward functions, report the sample that broke one.

``data.reward`` names one function or a list (``math``, ``path/to/file.py:fn``, ``package.module:fn``),
``data.reward_weights`` their weights; see :mod:`hybridflow.data.reward_functions` for the signatures.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.data.records import GroundTruth
from hybridflow.data.reward_functions import (
    FLOAT32_MAX,
    RewardFunction,
    Sample,
    describe,
    reward_function,
)
from hybridflow.data.reward_pool import RewardPool
from hybridflow.data.reward_service import RewardService, RewardServiceConfig
from hybridflow.data.reward_specs import RewardSpec, load_reward_functions
from hybridflow.fields import FieldError
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.errors import RewardFunctionError

RewardRule = Callable[..., float]


@dataclass(frozen=True, kw_only=True)
class RewardScorer:
    """A :class:`~hybridflow.runtime.protocols.Scorer`: the weighted sum of ``rewards`` over decoded samples.

    With ``timeout_s`` the functions run in ``workers`` processes of their own (:mod:`.reward_pool`, started
    at the first score), each call within ``timeout_s`` seconds: a hung call fails with
    :class:`~hybridflow.runtime.errors.RewardTimeoutError`. Without it they run in this process, unbounded.
    :meth:`close` stops the processes.
    """

    rewards: tuple[RewardFunction, ...]
    tokenizer: Any
    timeout_s: float | None = None
    workers: int | None = None  # default: up to 4, one per CPU
    timeout_name: str = "timeout_s"  # how a late call's error names the deadline (the caller's spelling of it)
    _pool: _LazyPool = field(init=False, repr=False, compare=False)
    _means: _RewardMeans = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.rewards:
            raise ValueError("RewardScorer needs at least one reward function")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise FieldError("timeout_s", self.timeout_s, "must be > 0 (seconds per call)")
        object.__setattr__(self, "_pool", _LazyPool())
        object.__setattr__(self, "_means", _RewardMeans())

    def __call__(self, batch: Batch) -> Batch:
        total, _ = self.score(batch_samples(batch, self.tokenizer))
        return Batch({"scores": torch.tensor(total, dtype=torch.float32)})

    def score(self, samples: Sequence[Sample], *,
              track: bool = True) -> tuple[list[float], dict[str, list[float | None]]]:
        """The weighted total per sample over the functions that scored it (a None is TRL's "not mine"), and each
        function's unweighted rewards (None where it skipped; for validation tables). ``track``: count them in
        :meth:`drain_means` (training samples; validation and probes pass False)."""
        values: list[list[float | None]] = [[] for _ in self.rewards]
        extras: dict[str, list[float]] = {}
        pooled = [i for i, reward in enumerate(self.rewards)
                  if self.timeout_s is not None and reward.style != "service"]
        if pooled:
            assert self.timeout_s is not None
            pool = self._pool.get([self.rewards[i] for i in pooled], self.timeout_s, self.workers, self.timeout_name)
            for position, value in zip(pooled, pool.score(samples), strict=True):
                values[position] = value
        for position, reward in enumerate(self.rewards):
            if isinstance(reward.fn, RewardService):  # in this process: its requests have their own deadline
                answer = reward.fn.score(samples)
                values[position] = list(answer.rewards)
                extras.update(answer.extras)
            elif position not in pooled:
                values[position] = reward(samples)
        total = [self._total(values, i, sample) for i, sample in enumerate(samples)]
        for sample, score in zip(samples, total, strict=True):
            if not abs(score) <= FLOAT32_MAX:  # each value was in range: only the weighted sum can overflow
                raise RewardFunctionError(
                    f"the weighted sum of reward functions {[r.name for r in self.rewards]} (weights "
                    f"{[r.weight for r in self.rewards]}) is {score!r} for {describe(sample)}, beyond float32's range; "
                    "lower the weights or the rewards", sample=sample.index)
        parts: dict[str, list[float | None]] = {}
        for position, (reward, value) in enumerate(zip(self.rewards, values, strict=True)):
            parts[reward.name if reward.name not in parts else f"{reward.name}#{position}"] = value
        if track:
            self._means.add({**extras, **parts})
        return total, parts

    def _total(self, values: Sequence[Sequence[float | None]], index: int, sample: Sample) -> float:
        answered = [(r.weight, v[index]) for r, v in zip(self.rewards, values, strict=True) if v[index] is not None]
        if not answered:
            names = [r.name for r in self.rewards]
            who = f"reward function {names[0]!r} returned None" if len(names) == 1 else \
                f"every reward function ({names}) returned None"
            raise RewardFunctionError(f"{who} for {describe(sample)}: None means 'not scored by this function', and "
                                      "each sample needs a score from at least one function (return a float, or add "
                                      "a function that scores such samples)", sample=sample.index)
        return sum(weight * float(value) for weight, value in answered if value is not None)

    def drain_means(self) -> dict[str, float]:
        """``reward/<name>/mean`` of every function over the samples it scored since the last drain (None skipped:
        TRL's ``rewards/<name>/mean``), and of each extra a reward service logged (``extra_logs``, ``scores``);
        empty when nothing was scored. The training loop drains once per step."""
        return self._means.drain()

    def close(self) -> None:
        """Stop the worker processes and close the reward services' connections; a later score reopens them."""
        self._pool.close()
        for reward in self.rewards:
            if isinstance(reward.fn, RewardService):
                reward.fn.close()


class _RewardMeans:
    """Running sums and counts of each function's rewards (None skipped), thread-safe: scores of one step may come
    from several chunks or threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[str, list[float]] = {}

    def add(self, parts: Mapping[str, Sequence[float | None]]) -> None:
        with self._lock:
            for name, values in parts.items():
                answered = [v for v in values if v is not None]
                entry = self._sums.setdefault(name, [0.0, 0.0])
                entry[0] += sum(answered)
                entry[1] += len(answered)

    def drain(self) -> dict[str, float]:
        with self._lock:
            sums, self._sums = self._sums, {}
        return {f"reward/{name}/mean": total / count for name, (total, count) in sums.items() if count}


class _LazyPool:
    """The scorer's process pool, started by the first score that needs it (config checks load scorers too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: RewardPool | None = None

    def get(self, rewards: Sequence[RewardFunction], timeout_s: float, workers: int | None,
            timeout_name: str) -> RewardPool:
        with self._lock:
            if self._pool is None:
                self._pool = RewardPool(rewards, timeout_s=timeout_s, workers=workers, timeout_name=timeout_name)
            return self._pool

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None


@dataclass(frozen=True)
class RuleScorer:
    """One reward function as a scorer: ``RuleScorer(rule, tokenizer)``; ``rule`` may take any accepted signature."""

    rule: RewardRule
    tokenizer: Any
    _scorer: RewardScorer = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        name = getattr(self.rule, "__name__", repr(self.rule))
        object.__setattr__(self, "_scorer", RewardScorer(rewards=(reward_function(self.rule, name=name),),
                                                         tokenizer=self.tokenizer))

    def __call__(self, batch: Batch) -> Batch:
        return self._scorer(batch)


def batch_samples(batch: Batch, tokenizer: Any) -> list[Sample]:
    """The rows of a score node's batch as :class:`Sample`s (prompts and responses decoded)."""
    texts = decode_responses(batch["responses"], batch["response_mask"], tokenizer)
    prompt_mask = batch["prompt_mask"] if "prompt_mask" in batch else torch.ones_like(batch["prompts"])
    prompts = decode_responses(batch["prompts"], prompt_mask, tokenizer)
    samples = []
    for i, (text, truth) in enumerate(zip(texts, batch["ground_truth"], strict=True)):
        context = truth if isinstance(truth, GroundTruth) else None
        ids = batch["responses"][i][batch["response_mask"][i].bool()].tolist()
        samples.append(Sample(index=i, prompt=context.prompt if context is not None and context.prompt else prompts[i],
                              prompt_text=prompts[i], response=text, ground_truth=str(truth),
                              data_source=context.data_source if context is not None else None,
                              extra_info=context.extra_info if context is not None else None,
                              columns=context.columns if context is not None else None, response_ids=ids))
    return samples


def reward_scorer(specs: RewardSpec | Sequence[RewardSpec], tokenizer: Any, *,
                  weights: Sequence[float] | None = None, timeout_s: float | None = None,
                  timeout_name: str = "timeout_s", service: RewardServiceConfig | None = None,
                  service_prefix: str = "") -> RewardScorer:
    """A scorer summing the weighted reward functions ``specs`` name (in worker processes with ``timeout_s``,
    which a late call's error calls ``timeout_name``); service URLs are called as ``service`` says, its options
    spelled under ``service_prefix`` in their errors."""
    rewards = load_reward_functions(specs, weights=weights, service=service, service_prefix=service_prefix)
    return RewardScorer(rewards=rewards, tokenizer=tokenizer, timeout_s=timeout_s, timeout_name=timeout_name)


def decode_responses(responses: torch.Tensor, mask: torch.Tensor, tokenizer: Any) -> list[str]:
    """Text of each response's unmasked tokens (special tokens such as EOS dropped)."""
    return [tokenizer.decode(row[m.bool()].tolist(), skip_special_tokens=True) for row, m in zip(responses, mask,
                                                                                                strict=True)]
