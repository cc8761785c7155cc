"""Reward functions of three shapes, recognised (and checked) when loaded, and their weighted sum.

Accepted signatures:

- per sample: ``fn(response, ground_truth)`` or ``fn(response, ground_truth, *, data_source=None,
  extra_info=None)`` (either keyword, or ``**kwargs``) -> float;
- verl's: ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` -> float;
- batched, TRL's: ``fn(prompts, completions, **columns)`` -> list of floats, called with keywords
  (``completions`` is what marks it; ``prompts``, ``completion_ids`` and any data column may be asked for).

Every value must be a real, finite number or ``None``: a string, NaN or inf is an error naming the
function, the sample, its prompt and its response. ``None`` (TRL's convention) means "this function does not
score this sample": the sample's reward is the weighted sum over the functions that did
(:class:`~hybridflow.data.rewards.RewardScorer`), and a sample no function scored is an error. So is anything
the function raises, ``SystemExit`` and other ``BaseException``s included (only ``KeyboardInterrupt`` goes
through: it is the user's).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from hybridflow.data.records import Messages
from hybridflow.runtime.errors import RewardFunctionError

Style = Literal["per_sample", "verl", "batched", "service"]  # service: fn(samples), a reward service
ACCEPTED = ("fn(response, ground_truth) or fn(response, ground_truth, *, data_source=None, extra_info=None); "
            "verl's compute_score(data_source, solution_str, ground_truth, extra_info=None); "
            "or TRL's batched fn(prompts, completions, **columns) -> list[float]")
PER_SAMPLE_KEYWORDS = ("data_source", "extra_info")
VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCH_ARGS = ("prompts", "completions", "completion_ids")


class RewardSignatureError(TypeError):
    """A reward function whose signature is none of the accepted ones."""


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One scored row: the prompt as given (text or chat messages), the text the policy saw, its response."""

    index: int
    prompt: str | Messages
    prompt_text: str
    response: str
    ground_truth: str
    data_source: str | None = None
    extra_info: Mapping[str, Any] | None = None
    columns: Mapping[str, Any] | None = None
    response_ids: Sequence[int] = ()


@dataclass(frozen=True, kw_only=True)
class RewardFunction:
    """A user function, how to call it (``style``) and its ``weight`` in the total reward."""

    name: str
    fn: Callable[..., Any]
    style: Style
    keywords: frozenset[str]  # keyword arguments it names (beyond the positional response/ground truth)
    any_keyword: bool  # it takes **kwargs
    required: frozenset[str]  # batched: data columns it cannot do without
    weight: float = 1.0
    source: str | None = None  # the data.reward spec it was loaded from: a worker process loads it by this

    def __call__(self, samples: Sequence[Sample]) -> list[float | None]:
        """Unweighted rewards of ``samples``, checked to be finite floats (or None: not scored by this function)."""
        if self.style == "batched":
            return self._batched(samples)
        if self.style == "service":  # checks its own answers, naming its URL (data/reward_service.py)
            return list(self.fn(samples))
        return [self._one(sample) for sample in samples]

    def _one(self, sample: Sample) -> float | None:
        if self.style == "verl":
            offered = {"data_source": sample.data_source, "solution_str": sample.response,
                       "ground_truth": sample.ground_truth, "extra_info": sample.extra_info}
            args: tuple[Any, ...] = ()
        else:
            offered = {"data_source": sample.data_source, "extra_info": sample.extra_info}
            args = (sample.response, sample.ground_truth)
        kwargs = {k: v for k, v in offered.items() if self.any_keyword or k in self.keywords}
        try:
            value = self.fn(*args, **kwargs)
        except KeyboardInterrupt:
            raise
        except BaseException as err:  # any user error, sys.exit too: re-raise naming the sample
            raise RewardFunctionError(f"reward function {self.name!r} raised {type(err).__name__}: {err} on "
                                      f"{describe(sample)}", sample=sample.index) from err
        return check_value(value, self.name, sample)

    def _batched(self, samples: Sequence[Sample]) -> list[float | None]:
        columns = batch_columns(samples)
        missing = sorted(self.required - set(columns))
        if missing:
            raise KeyError(f"reward function {self.name!r} needs data column(s) {missing}; the rows have "
                           f"{sorted(columns)} (add the column to the data, or give the parameter a default)")
        offered: dict[str, Any] = {
            "prompts": [s.prompt for s in samples],
            # TRL's convention: a chat prompt's completion is a list with one assistant message.
            "completions": [[{"role": "assistant", "content": s.response}] if isinstance(s.prompt, list)
                            else s.response for s in samples],
            "completion_ids": [list(s.response_ids) for s in samples], **columns}
        kwargs = {k: v for k, v in offered.items() if self.any_keyword or k in self.keywords}
        try:
            values = self.fn(**kwargs)
        except KeyboardInterrupt:
            raise
        except BaseException as err:
            raise RewardFunctionError(f"reward function {self.name!r} raised {type(err).__name__}: {err} on a batch "
                                      f"of {len(samples)} samples (first: {describe(samples[0])})",
                                      sample=samples[0].index) from err
        if isinstance(values, str | bytes) or not isinstance(values, Sequence) or len(values) != len(samples):
            size = len(values) if isinstance(values, Sequence) else type(values).__name__
            raise RewardFunctionError(f"reward function {self.name!r} is batched (it takes 'completions') and must "
                                      f"return a list of {len(samples)} floats, one per completion; it returned "
                                      f"{size!r}", sample=samples[0].index)
        return [check_value(value, self.name, sample) for value, sample in zip(values, samples, strict=True)]


def batch_columns(samples: Sequence[Sample]) -> dict[str, list[Any]]:
    """Data columns of ``samples`` as lists (TRL passes every non-prompt column this way)."""
    names: dict[str, None] = dict.fromkeys(("ground_truth", "data_source", "extra_info"))
    for sample in samples:
        names.update(dict.fromkeys(sample.columns or {}))
    columns: dict[str, list[Any]] = {}
    for name in names:
        if name in ("ground_truth", "data_source", "extra_info"):
            columns[name] = [getattr(s, name) for s in samples]
        else:
            columns[name] = [(s.columns or {}).get(name) for s in samples]
    return columns


def reward_function(fn: Callable[..., Any], *, name: str | None = None, weight: float = 1.0) -> RewardFunction:
    """Inspect ``fn`` once, at load time: its style and the keywords it takes, or an error listing the accepted ones."""
    label = name or getattr(fn, "__qualname__", None) or repr(fn)
    if not callable(fn):
        raise RewardSignatureError(f"reward function {label!r} is a {type(fn).__name__}, not a function")
    if not (isinstance(weight, numbers.Real) and math.isfinite(weight)):
        raise ValueError(f"reward function {label!r}: weight {weight!r} must be a finite number")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as err:
        raise RewardSignatureError(f"reward function {label!r}: its signature cannot be read ({err}); wrap it in a "
                                   f"def with one of: {ACCEPTED}") from err
    names = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    any_keyword = any(p.kind is p.VAR_KEYWORD for p in params)
    required = {p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}

    def made(style: Style, keywords: Collection[str], needs: Collection[str] = ()) -> RewardFunction:
        return RewardFunction(name=label, fn=fn, style=style, keywords=frozenset(keywords), any_keyword=any_keyword,
                              required=frozenset(needs), weight=float(weight))

    def refuse(why: str) -> RewardSignatureError:
        return RewardSignatureError(f"reward function {label!r} has signature {inspect.signature(fn)}: {why}. "
                                    f"Accepted signatures: {ACCEPTED}")

    if "completions" in names:
        positional_only = [p.name for p in params if p.kind is p.POSITIONAL_ONLY]
        if positional_only:
            raise refuse(f"batched functions are called with keywords, so {positional_only} cannot be "
                         "positional-only")
        return made("batched", names, required - set(BATCH_ARGS))
    if "solution_str" in names:
        extra = sorted(required - set(VERL_ARGS))
        if extra:
            raise refuse(f"verl-style functions get only {list(VERL_ARGS)}, not {extra}")
        return made("verl", names & set(VERL_ARGS))
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_two = len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)
    if not takes_two:
        raise refuse("it must take the response and the ground truth as its first two positional arguments")
    rest = [p for p in params[2:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    extra = sorted(p.name for p in rest if p.default is p.empty and p.name not in PER_SAMPLE_KEYWORDS)
    if extra:
        raise refuse(f"per-sample functions get only data_source and extra_info after (response, ground_truth), so "
                     f"{extra} need defaults")
    return made("per_sample", {p.name for p in rest} & set(PER_SAMPLE_KEYWORDS))


FLOAT32_MAX = 3.4028234663852886e38  # scores travel as float32 tensors: a larger reward becomes inf there


def check_value(value: Any, name: str, sample: Sample) -> float | None:
    """``value`` as a float if it is a real, finite number, None as None (the function skips the sample);
    otherwise an error naming the function and sample."""
    if value is None:
        return None
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # 0-d numpy arrays and torch tensors
        value = value.item()
    if isinstance(value, numbers.Real) and math.isfinite(float(value)) and abs(float(value)) <= FLOAT32_MAX:
        return float(value)
    if not isinstance(value, numbers.Real):
        why = f"is a {type(value).__name__}, not a number"
    elif math.isfinite(float(value)):
        why = f"is beyond float32's range (|reward| <= {FLOAT32_MAX:.3g}; scores are float32 tensors, where it is inf)"
    else:
        why = "is not finite"
    raise RewardFunctionError(f"reward function {name!r} returned {value!r}, which {why}, for {describe(sample)}; "
                              "reward functions must return real, finite floats", sample=sample.index)


def describe(sample: Sample, width: int = 200) -> str:
    """``sample i (prompt ..., response ..., ground truth ...)``, each clipped to ``width`` characters."""
    prompt = sample.prompt_text or str(sample.prompt)
    return (f"sample {sample.index} (prompt {_clip(prompt, width)!r}, response {_clip(sample.response, width)!r}, "
            f"ground truth {_clip(sample.ground_truth, width)!r})")


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width] + "..."
