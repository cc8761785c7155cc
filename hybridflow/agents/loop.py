"""The agent loop: one trajectory per row, its turns sampled through a :class:`TurnServer`, its world an
:class:`Environment`, its tokens accumulated as sampled (:mod:`hybridflow.agents.chat`).

Two schedules (``agent_schedule``):

- ``trajectory``: every trajectory advances on its own thread (the first turns, all ready at once, go as one
  batch). A finished turn's observation is templated and its next request sent at once, while other
  trajectories still wait on tools; the server batches whatever requests are ready. A slow tool delays only
  its own trajectory.
- ``turn``: batch-synchronous turns. Every live trajectory samples turn t in one batch, then all of them step
  their environments, and turn t+1 starts once the slowest is back (the schedule most frameworks began with).

A trajectory ends when its environment says done, at ``max_turns``, when a turn is cut by the token budget
before its end token (``truncated``), or when the next observation no longer fits the trajectory's budget
(``truncated``). An environment that raises (``SystemExit`` included) or does not return from ``reset``,
``step`` or ``observe_turn`` within its deadline fails the call with :class:`EnvironmentFailure`, naming the
environment, the row and the turn; a tool's misbehaviour never does (it is the environment's observation).
The deadline is the environment's own ``step_timeout_s`` attribute when it has one, else
``AgentSettings.env_timeout_s`` (:data:`ENV_TIMEOUT_S`). A hung call's thread cannot be stopped: it is left
behind (a daemon thread, so the process can still exit) and the rollout fails at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import numbers
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from hybridflow.agents.chat import ChatRenderer
from hybridflow.agents.protocols import (
    Environment,
    EnvRecord,
    EnvStep,
    Message,
    Prompt,
    ToolResult,
    TurnObserver,
    TurnRequest,
    TurnResult,
    TurnServer,
)
from hybridflow.graph.node import AGENT_SCHEDULES, DEFAULT_MAX_TURNS

SCHEDULES = AGENT_SCHEDULES  # the graph node option agent_schedule takes these
_T = TypeVar("_T")
TURN_SEED_STRIDE = 7919  # a row's turn t samples with its seed + t x this (the rows' seeds are further apart)
ENV_TIMEOUT_S = 60.0  # seconds an environment's reset/step/observe_turn may take, unless it sets step_timeout_s


class EnvironmentFailure(RuntimeError):
    """An environment raised in ``reset`` or ``step``: the rollout cannot go on for that row."""


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    """How far a trajectory may go: turns, sampled tokens per turn, and the whole response's tokens."""

    max_turns: int = DEFAULT_MAX_TURNS
    max_turn_tokens: int = 32
    max_tokens: int = 128
    schedule: str = "trajectory"
    env_timeout_s: float = ENV_TIMEOUT_S  # each environment call's deadline (an environment's step_timeout_s wins)

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_turn_tokens", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"agent setting {name}={value!r} must be a positive integer")
        if not self.env_timeout_s > 0:
            raise ValueError(f"agent setting env_timeout_s={self.env_timeout_s!r} must be > 0 (seconds)")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"agent_schedule={self.schedule!r} must be one of {list(SCHEDULES)}")


@dataclass(kw_only=True)
class Trajectory:
    """One row's rollout: the prompt it started from and every response token with how it got there."""

    index: int
    environment: str
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)  # True: the policy sampled it (loss); False: observation
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the weights version of each token (-1: observation)
    turns: int = 0
    tool_results: list[ToolResult] = field(default_factory=list)
    parse_errors: int = 0
    env_reward: float = 0.0
    truncated: bool = False
    finished: bool = False
    transcript: list[Message] = field(default_factory=list)

    def extend(self, token_ids: Sequence[int], *, sampled: bool, logprobs: Sequence[float] = (),
               version: int = -1) -> None:
        self.tokens.extend(token_ids)
        self.sampled.extend([sampled] * len(token_ids))
        self.logprobs.extend(logprobs if sampled else [0.0] * len(token_ids))
        self.versions.extend([version if sampled else -1] * len(token_ids))

    def trace(self) -> str:
        """A JSON summary of the trajectory (metrics and the validation samples table read it)."""
        return json.dumps({"turns": self.turns, "truncated": self.truncated, "env_reward": self.env_reward,
                           "parse_errors": self.parse_errors,
                           "tools": [{"name": r.call.name, "seconds": round(r.seconds, 6), "error": r.error,
                                      "timed_out": r.timed_out} for r in self.tool_results],
                           "transcript": self.transcript})


class _Runner:
    """One trajectory's state machine: the next request, then what its result leads to."""

    def __init__(self, trajectory: Trajectory, env: Environment, record: EnvRecord, *, renderer: ChatRenderer,
                 settings: AgentSettings, seed: int) -> None:
        self.trajectory, self.env, self.record = trajectory, env, record
        self.renderer, self.settings, self.seed = renderer, settings, seed
        self.live = True

    def _call(self, what: str, fn: Callable[..., _T], *args: object, **kwargs: object) -> _T:
        """``fn(*args, **kwargs)``, one of the environment's methods, under its deadline; any failure named."""
        where = f"on row {self.record.index} (turn {self.trajectory.turns})"
        timeout_s = float(getattr(self.env, "step_timeout_s", None) or self.settings.env_timeout_s)
        try:
            return _within(timeout_s, fn, *args, **kwargs)
        except _Late:
            raise EnvironmentFailure(f"environment {self.trajectory.environment!r} did not return from {what} within "
                                     f"{timeout_s} s {where}; make it faster or set its step_timeout_s") from None
        except KeyboardInterrupt:
            raise
        except BaseException as err:  # sys.exit() in an environment must fail the rollout, naming it
            raise EnvironmentFailure(f"environment {self.trajectory.environment!r} raised in {what} {where}: "
                                     f"{type(err).__name__}: {err}") from err

    def _returned(self, what: str, value: object, wanted: str) -> EnvironmentFailure:
        """A failure naming the environment, the method, what it returned and should have, the row and turn."""
        return EnvironmentFailure(f"environment {self.trajectory.environment!r} returned {_shown(value)} from "
                                  f"{what} on row {self.record.index} (turn {self.trajectory.turns}); {wanted}")

    def start(self) -> None:
        shown = self._call("reset", self.env.reset, self.record)
        if not (shown is None or isinstance(shown, Prompt) or _messages(shown)):
            raise self._returned("reset", shown, "reset must return a list of messages (dicts with 'role' and "
                                 "'content'), [] or a Prompt")
        if isinstance(shown, Prompt):  # the environment's own prompt replaces the row's
            self.trajectory.prompt_ids = self.renderer.prompt_ids(shown.messages, tools=shown.tools)
        elif shown:  # messages before the first turn: nothing is sampled yet, so the prompt is rendered anew
            prompt = self.record.prompt
            messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
            self.trajectory.prompt_ids = self.renderer.prompt_ids([*messages, *shown])
            self.trajectory.transcript.extend(shown)

    def request(self) -> TurnRequest | None:
        if not self.live:
            return None
        trajectory = self.trajectory
        budget = min(self.settings.max_turn_tokens, self.settings.max_tokens - len(trajectory.tokens))
        if budget < 1:
            trajectory.truncated, self.live = True, False
            return None
        return TurnRequest(token_ids=(*trajectory.prompt_ids, *trajectory.tokens), max_tokens=budget,
                           seed=self.seed + trajectory.turns * TURN_SEED_STRIDE, session=self.session)

    @property
    def session(self) -> str:
        """The trajectory's session key: its prompt and seed (fixed once ``start`` has run), so every turn carries
        the same one and two samples of one prompt (different seeds) may go to different replicas."""
        key = f"{self.seed}:{self.trajectory.prompt_ids}"
        return hashlib.sha1(key.encode()).hexdigest()[:16]

    def take(self, result: TurnResult) -> None:
        """Append a sampled turn; step the environment on it and append its observation, or end."""
        trajectory = self.trajectory
        if isinstance(self.env, TurnObserver):
            self._call("observe_turn", self.env.observe_turn,
                       prompt_tokens=len(trajectory.prompt_ids) + len(trajectory.tokens), result=result)
        trajectory.extend(result.token_ids, sampled=True, logprobs=result.logprobs, version=result.version)
        trajectory.turns += 1
        ended = result.finished and result.token_ids and result.token_ids[-1] == self.renderer.turn_end_id
        text = self.renderer.decode(result.token_ids[:-1] if ended else result.token_ids)
        trajectory.transcript.append({"role": "assistant", "content": text})
        if not result.finished:
            trajectory.truncated, self.live = True, False
            return
        step: EnvStep = self._call("step", self.env.step, text)
        if not isinstance(step, EnvStep) or not _messages(step.observation):
            raise self._returned("step", step, "step must return an EnvStep(observation=[messages], reward=float, "
                                 "done=bool)")
        if isinstance(step.reward, bool) or not isinstance(step.reward, numbers.Real) or not math.isfinite(step.reward):
            raise self._returned("step", step, "its reward must be a finite number (the run's reward, and so the "
                                 "loss, would not be one)")
        trajectory.env_reward += float(step.reward)
        trajectory.tool_results.extend(step.tool_results)
        trajectory.parse_errors += int(step.info.get("parse_errors", 0))
        if step.done:
            trajectory.finished, self.live = True, False
            return
        if trajectory.turns >= self.settings.max_turns:
            self.live = False
            return
        observation = self.renderer.observation_ids(step.observation)
        if len(trajectory.tokens) + len(observation) >= self.settings.max_tokens:
            trajectory.truncated, self.live = True, False  # no room for the observation and a turn after it
            return
        trajectory.extend(observation, sampled=False)
        trajectory.transcript.extend(step.observation)


def _messages(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) for item in value)


def _shown(value: object, width: int = 120) -> str:
    text = repr(value)
    text = text[:width] + "..." if len(text) > width else text
    return text if text.startswith(type(value).__name__) else f"{type(value).__name__} {text}"


class _Late(Exception):
    """A call ran past its deadline."""


def _within(timeout_s: float, fn: Callable[..., _T], *args: object, **kwargs: object) -> _T:
    """``fn``'s value or exception, on a daemon thread of its own; :class:`_Late` past ``timeout_s``."""
    done = threading.Event()
    values: list[_T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            values.append(fn(*args, **kwargs))
        except BaseException as err:  # handed to the caller, which names it
            errors.append(err)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name="environment-call").start()
    if not done.wait(timeout_s):
        raise _Late
    if errors:
        raise errors[0]
    return values[0]


def run_trajectories(records: Sequence[EnvRecord], prompt_ids: Sequence[Sequence[int]], *, server: TurnServer,
                     renderer: ChatRenderer, make_env: Callable[[EnvRecord], Environment], environment: str,
                     settings: AgentSettings, seeds: Sequence[int], executor: ThreadPoolExecutor | None = None,
                     ) -> list[Trajectory]:
    """Roll out one trajectory per record under ``settings.schedule``; environments are closed at the end."""
    if not len(records) == len(prompt_ids) == len(seeds):
        raise ValueError(f"run_trajectories: {len(records)} records, {len(prompt_ids)} prompts, {len(seeds)} seeds")
    runners = [_Runner(Trajectory(index=record.index, environment=environment, prompt_ids=list(ids)),
                       make_env(record), record, renderer=renderer, settings=settings, seed=seed)
               for record, ids, seed in zip(records, prompt_ids, seeds, strict=True)]
    own = executor is None
    pool = executor or ThreadPoolExecutor(max_workers=max(len(runners), 1), thread_name_prefix="trajectory")
    try:
        if settings.schedule == "trajectory":
            _run_independently(runners, server, pool)
        else:
            _run_turn_by_turn(runners, server, pool)
    finally:
        for runner in runners:
            _close(runner.env)
        if own:
            pool.shutdown(wait=False, cancel_futures=True)
    return [runner.trajectory for runner in runners]


def _run_independently(runners: Sequence[_Runner], server: TurnServer, pool: ThreadPoolExecutor) -> None:
    """Every first turn is ready at once (no tool precedes it), so they go as one batch; submitted from each
    thread as its reset returned, the server took the first arrivals alone ([2, 30] of 32 rows on CPU)."""
    for future in [pool.submit(runner.start) for runner in runners]:
        future.result()
    asked = [(runner, request) for runner in runners if (request := runner.request()) is not None]
    firsts = server.submit_many([request for _, request in asked])

    def advance(runner: _Runner, first: Future[TurnResult]) -> None:
        runner.take(first.result())
        while (request := runner.request()) is not None:
            runner.take(server.submit(request).result())

    for future in [pool.submit(advance, runner, first) for (runner, _), first in zip(asked, firsts, strict=True)]:
        future.result()


def _run_turn_by_turn(runners: Sequence[_Runner], server: TurnServer, pool: ThreadPoolExecutor) -> None:
    for future in [pool.submit(runner.start) for runner in runners]:
        future.result()
    live = list(runners)
    while live:
        asked = [(runner, request) for runner in live if (request := runner.request()) is not None]
        futures = server.submit_many([request for _, request in asked])  # one batch: the turn's every row
        sampled = [(runner, future.result()) for (runner, _), future in zip(asked, futures, strict=True)]
        for future in [pool.submit(runner.take, result) for runner, result in sampled]:
            future.result()
        live = [runner for runner, _ in asked if runner.live]


def _close(env: Environment) -> None:
    try:
        env.close()
    except Exception as err:  # reported, not raised: a close failure must not mask the rollout's own outcome
        logging.getLogger(__name__).warning("environment %s failed to close: %s: %s", type(env).__name__,
                                            type(err).__name__, err)
