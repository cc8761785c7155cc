"""Reward services: a reward function behind an HTTP endpoint, named in ``data.reward`` by its URL.

Three request shapes, the first two as the frameworks users come from spell them:

- ``batch`` (OpenRLHF's remote reward model): one POST per batch of samples with
  ``{"query": [prompt + response], "prompts": [prompt], "labels": [ground truth]}``, answered
  ``{"rewards": [...]}``, optionally with ``"scores"`` and ``"extra_logs"`` (name -> one float per sample);
- ``per_sample`` (slime's remote reward model): one POST per sample with ``{"prompt", "response", "label"}``,
  answered with a bare number or an object holding the reward at ``reward_key``;
- ``chat``: an OpenAI-compatible chat endpoint as a judge, one request per sample (:mod:`.reward_judge`).

Requests go through one ``httpx.Client`` per service, at most ``max_concurrency`` at a time, each within
``timeout_s`` seconds and an answer of at most ``max_body_bytes``. A connection error, a timeout, 429 or a 5xx
status is retried ``retries`` times after ``backoff_s * 2**attempt`` seconds; then, and on any bad answer, the
step fails with a :class:`~hybridflow.runtime.errors.RewardFunctionError` naming the URL and what went wrong.
"""

from __future__ import annotations

import json
import math
import numbers
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from hybridflow.data.reward_functions import FLOAT32_MAX, Sample, describe
from hybridflow.data.reward_judge import (
    DEFAULT_JUDGE_TEMPLATE,
    JudgeAnswerError,
    api_key_headers,
    chat_url,
    judge_payload,
    judge_verdict,
    template_problem,
)
from hybridflow.fields import FieldError
from hybridflow.runtime.errors import RewardFunctionError, RewardTimeoutError

Shape = Literal["batch", "per_sample", "chat"]
SHAPES: tuple[str, ...] = ("batch", "per_sample", "chat")
URL_SCHEMES = ("http://", "https://")


def is_service_url(spec: object) -> bool:
    """Whether a reward spec names an HTTP endpoint rather than a function."""
    return isinstance(spec, str) and spec.startswith(URL_SCHEMES)


@dataclass(frozen=True, kw_only=True)
class RewardServiceConfig:
    """How the reward services a run names by URL are called (every URL of ``data.reward`` alike).

    ``shape``: ``batch`` (OpenRLHF), ``per_sample`` (slime) or ``chat`` (a judge model at an OpenAI-compatible
    base URL: ``model``, the key in environment variable ``api_key_env``, ``prompt_template``); ``reward_key``:
    where a per-sample answer holds the reward; ``batch_size``: samples per batch request (none: the whole
    scored batch); ``max_concurrency``: requests in flight; ``timeout_s``: each request's deadline; ``retries``
    and ``backoff_s``: the retries of a connection error, timeout, 429 or 5xx, after ``backoff_s * 2**attempt``
    seconds; ``max_body_bytes``: the largest answer read.
    """

    shape: Shape = "batch"
    reward_key: str = "reward"
    batch_size: int | None = None
    max_concurrency: int = 8
    timeout_s: float = 30.0
    retries: int = 3
    backoff_s: float = 0.5
    max_body_bytes: int = 16 * 2**20
    model: str | None = None
    api_key_env: str | None = None
    prompt_template: str = DEFAULT_JUDGE_TEMPLATE

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise FieldError("shape", self.shape, f"is not a request shape; use one of {list(SHAPES)}")
        if not self.reward_key:
            raise FieldError("reward_key", self.reward_key, "must name the answer's reward field (e.g. reward)")
        for name in ("batch_size", "max_concurrency", "max_body_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise FieldError(name, value, "must be >= 1")
        if not self.timeout_s > 0:
            raise FieldError("timeout_s", self.timeout_s, "must be > 0 (seconds per request)")
        if self.retries < 0:
            raise FieldError("retries", self.retries, "must be >= 0 (0: no retry)")
        if self.backoff_s < 0:
            raise FieldError("backoff_s", self.backoff_s, "must be >= 0 (seconds before the first retry)")
        if self.shape == "chat" and not self.model:
            raise FieldError("model", self.model, "is required with shape=chat: the judge model's name",
                             related=("shape",))
        problem = template_problem(self.prompt_template)
        if problem is not None:
            raise FieldError("prompt_template", reason=problem)


@dataclass(frozen=True)
class ServiceScores:
    """A service's rewards of a batch, one per sample, and the per-sample extras it asked to log."""

    rewards: list[float]
    extras: dict[str, list[float]]


class ServiceAnswerError(Exception):
    """A request's answer that cannot be read (its text names what is wrong); never retried."""


class _Retryable(Exception):
    """A failure worth another attempt: a connection error, a timeout, 429 or a 5xx status."""

    def __init__(self, text: str, *, late: bool = False) -> None:
        super().__init__(text)
        self.late = late


class RewardService:
    """The reward service at ``url``: :meth:`score` (or a call) scores samples; thread-safe; :meth:`close`.

    ``option_prefix`` spells the options in errors as the caller's config does (``timeout_s`` by default).
    """

    def __init__(self, url: str, options: RewardServiceConfig | None = None, *, option_prefix: str = "") -> None:
        if not is_service_url(url) or len(url) <= len("https://"):
            raise FieldError("reward", url, "is not an http:// or https:// URL of a reward service")
        self.url, self.options, self.prefix = url, options or RewardServiceConfig(), option_prefix
        self.endpoint = chat_url(url) if self.options.shape == "chat" else url
        self._headers()  # an unset key is refused now, not at the first step
        self._lock = threading.Lock()
        self._client: httpx.Client | None = None
        self._threads: ThreadPoolExecutor | None = None

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        return self.score(samples).rewards

    def score(self, samples: Sequence[Sample]) -> ServiceScores:
        """Rewards of ``samples`` in order (and extras), or a ``RewardFunctionError`` naming the URL."""
        if not samples:
            return ServiceScores([], {})
        if self.options.shape != "batch":
            requests = [[sample] for sample in samples]
            read: Callable[[Any, list[Sample]], ServiceScores] = (self._read_one if self.options.shape == "per_sample"
                                                                  else self._read_verdict)
        else:
            width = self.options.batch_size or len(samples)
            requests = [list(samples[i:i + width]) for i in range(0, len(samples), width)]
            read = self._read_batch
        answers = self._run([(chunk, self._payload(chunk)) for chunk in requests], read)
        rewards = [value for answer in answers for value in answer.rewards]
        names = dict.fromkeys(name for answer in answers for name in answer.extras)
        extras = {name: [v for answer in answers for v in answer.extras.get(name, [])] for name in names}
        return ServiceScores(rewards, extras)

    def close(self) -> None:
        """Close the connections and threads; a later score opens new ones."""
        with self._lock:
            client, threads, self._client, self._threads = self._client, self._threads, None, None
        if threads is not None:
            threads.shutdown(wait=False, cancel_futures=True)
        if client is not None:
            client.close()

    def _payload(self, chunk: list[Sample]) -> dict[str, Any]:
        if self.options.shape == "chat":
            assert self.options.model is not None
            return judge_payload(chunk[0], model=self.options.model, template=self.options.prompt_template)
        if self.options.shape == "per_sample":
            sample = chunk[0]
            return {"prompt": sample.prompt_text, "response": sample.response, "label": sample.ground_truth}
        return {"query": [s.prompt_text + s.response for s in chunk], "prompts": [s.prompt_text for s in chunk],
                "labels": [s.ground_truth for s in chunk]}

    def _run(self, requests: list[tuple[list[Sample], dict[str, Any]]],
             read: Callable[[Any, list[Sample]], ServiceScores]) -> list[ServiceScores]:
        client, threads = self._connections()
        futures = [threads.submit(self._request, client, chunk, payload, read) for chunk, payload in requests]
        try:
            return [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise

    def _connections(self) -> tuple[httpx.Client, ThreadPoolExecutor]:
        with self._lock:
            if self._client is None or self._threads is None:
                width = self.options.max_concurrency
                self._client = httpx.Client(headers=self._headers(), limits=httpx.Limits(
                    max_connections=width, max_keepalive_connections=width))
                self._threads = ThreadPoolExecutor(width, thread_name_prefix="reward-service")
            return self._client, self._threads

    def _headers(self) -> dict[str, str]:
        try:
            return api_key_headers(self.options.api_key_env if self.options.shape == "chat" else None)
        except KeyError:
            raise ValueError(f"reward service {self.url}: {self.prefix}api_key_env={self.options.api_key_env!r} "
                             "names an environment variable that is not set (or empty); export the judge's API key "
                             "in it") from None

    def _request(self, client: httpx.Client, chunk: list[Sample], payload: dict[str, Any],
                 read: Callable[[Any, list[Sample]], ServiceScores]) -> ServiceScores:
        """One request's scores, retried on connection errors, timeouts, 429 and 5xx."""
        attempts = self.options.retries + 1
        failure = _Retryable("no attempt")
        what = describe(chunk[0]) if len(chunk) == 1 else f"{len(chunk)} samples (first: {describe(chunk[0])})"
        for attempt in range(attempts):
            try:
                status, body = self._post_once(client, payload)
            except _Retryable as err:
                failure = err
            except ServiceAnswerError as err:
                raise self._error(f"{err}, on {what}", chunk) from None
            else:
                if status == 429 or status >= 500:
                    failure = _Retryable(f"status {status} ({_snippet(body)})")
                elif status >= 400 or status < 200:
                    raise self._error(f"answered status {status} ({_snippet(body)}), which is not retried; check "
                                      f"the URL and the request shape ({self.prefix}shape={self.options.shape}), "
                                      f"on {what}", chunk)
                else:
                    try:
                        return read(_json(body), chunk)
                    except ServiceAnswerError as err:
                        raise self._error(f"{err}, on {what}", chunk) from None
            if attempt + 1 < attempts:
                time.sleep(self.options.backoff_s * 2 ** attempt)
        raise self._error(f"failed after {attempts} attempts, the last with {failure}, on {what}; check that the "
                          f"service is up, or raise {self.prefix}retries", chunk, late=failure.late)

    def _post_once(self, client: httpx.Client, payload: dict[str, Any]) -> tuple[int, bytes]:
        """The status and body of one POST, within ``timeout_s`` and ``max_body_bytes``."""
        timeout_s, cap = self.options.timeout_s, self.options.max_body_bytes
        late = _Retryable(f"no answer within {self.prefix}timeout_s={timeout_s} s", late=True)
        deadline = time.monotonic() + timeout_s
        try:
            with client.stream("POST", self.endpoint, json=payload, timeout=timeout_s) as response:
                length = response.headers.get("content-length")
                if length is not None and length.isdigit() and int(length) > cap:
                    raise ServiceAnswerError(f"answered a body of {int(length)} bytes, over "
                                             f"{self.prefix}max_body_bytes={cap}")
                body = bytearray()
                for part in response.iter_bytes():
                    body += part
                    if len(body) > cap:
                        raise ServiceAnswerError(f"answered a body over {self.prefix}max_body_bytes={cap} bytes")
                    if time.monotonic() > deadline:
                        raise late
                return response.status_code, bytes(body)
        except httpx.TimeoutException:
            raise late from None
        except httpx.TransportError as err:
            raise _Retryable(f"{type(err).__name__}: {err or 'no detail'}") from None

    def _read_batch(self, answer: Any, chunk: list[Sample]) -> ServiceScores:
        if not isinstance(answer, Mapping) or "rewards" not in answer:
            keys = sorted(answer) if isinstance(answer, Mapping) else type(answer).__name__
            raise ServiceAnswerError(f"answered {keys} without 'rewards'; a batch service answers "
                                     '{"rewards": [one float per query]} (or set '
                                     f"{self.prefix}shape=per_sample)")
        rewards = self._values(answer["rewards"], "rewards", chunk)
        extras: dict[str, list[float]] = {}
        if answer.get("scores") is not None:
            extras["scores"] = self._values(answer["scores"], "scores", chunk)
        logs = answer.get("extra_logs") or {}
        if not isinstance(logs, Mapping):
            raise ServiceAnswerError(f"answered extra_logs as a {type(logs).__name__}, not an object of name -> "
                                     "one float per query")
        for name, values in logs.items():
            extras[str(name)] = self._values(values, f"extra_logs[{name!r}]", chunk)
        return ServiceScores(rewards, extras)

    def _read_one(self, answer: Any, chunk: list[Sample]) -> ServiceScores:
        key = self.options.reward_key
        if isinstance(answer, Mapping):
            if key not in answer:
                raise ServiceAnswerError(f"answered an object with keys {sorted(answer)} and no {key!r}; set "
                                         f"{self.prefix}reward_key to the key that holds the reward")
            answer = answer[key]
        return ServiceScores([_number(answer, key, chunk[0])], {})

    def _read_verdict(self, answer: Any, chunk: list[Sample]) -> ServiceScores:
        try:
            verdict = judge_verdict(answer)
        except JudgeAnswerError as err:
            raise ServiceAnswerError(str(err)) from None
        return ServiceScores([_number(verdict, "verdict", chunk[0])], {})

    def _values(self, values: Any, name: str, chunk: list[Sample]) -> list[float]:
        if isinstance(values, str | bytes | Mapping) or not isinstance(values, Sequence):
            raise ServiceAnswerError(f"answered {name} as a {type(values).__name__}, not a list of "
                                     f"{len(chunk)} floats")
        if len(values) != len(chunk):
            raise ServiceAnswerError(f"answered {len(values)} {name} for {len(chunk)} samples")
        return [_number(value, name, sample) for value, sample in zip(values, chunk, strict=True)]

    def _error(self, text: str, chunk: list[Sample], *, late: bool = False) -> RewardFunctionError:
        kind = RewardTimeoutError if late else RewardFunctionError
        return kind(f"reward service {self.url} {text}", sample=chunk[0].index)


def _number(value: Any, name: str, sample: Sample) -> float:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
        if math.isfinite(number) and abs(number) <= FLOAT32_MAX:
            return number
        raise ServiceAnswerError(f"answered {name} {value!r} for sample {sample.index}, which is not a finite "
                                 "float32")
    raise ServiceAnswerError(f"answered {name} {value!r} for sample {sample.index}, a {type(value).__name__}, not a "
                             "number")


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise ServiceAnswerError(f"answered a body that is not JSON ({err}: {_snippet(body)})") from None


def _snippet(body: bytes, width: int = 120) -> str:
    text = body[:width].decode("utf-8", "replace").replace("\n", " ")
    return repr(text + ("..." if len(body) > width else ""))
