"""Environments written for other frameworks, run as hybridflow :class:`Environment` s.

- ``environment="skyrl"`` (:class:`SkyRLEnvironment`): a skyrl-gym ``BaseTextEnv``, by registry id
  (``env="gsm8k"``) or class (``env="my_envs.py:MazeEnv"``). Needs ``pip install 'hybridflow[agents]'``.
- ``environment="trl"`` (:class:`TRLEnvironment`): a TRL ``GRPOTrainer(environment_factory=...)`` class, whose
  public methods are the model's tools. TRL itself is not needed.

Neither framework is imported until an environment is built.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from hybridflow.agents.protocols import EnvRecord, EnvStep, Message, Tool, ToolCall, ToolCallFormat, ToolResult
from hybridflow.agents.records import ENVIRONMENT_COLUMN, row_columns
from hybridflow.registry import ENVIRONMENTS, TOOL_FORMATS, load_object

# Methods of a TRL environment that are not tools (TRL's own exclusions).
TRL_RESERVED = ("reset", "get_reward")


@ENVIRONMENTS.register("skyrl")
class SkyRLEnvironment:
    """A skyrl-gym text environment, made per row as SkyRL's generator makes it.

    ``env``: a skyrl-gym registry id (``"gsm8k"``, ``"gsm8k_multi_turn"``, ...) or ``path/file.py:Class`` /
    ``module:Class`` of a ``BaseTextEnv`` subclass. The other options are the environment's ``env_config``
    (SkyRL's ``environment.skyrl_gym.<env>`` section, given as an omegaconf ``DictConfig``); ``max_turns``, when
    set, goes into ``extras`` as SkyRL's generator puts it there.

    ``extras`` are the row's columns plus ``reward_spec`` (``{"method": "rule", "ground_truth": ...}``, unless
    the row has its own ``reward_spec`` column) and ``extra_info``. ``init`` may append messages to the prompt
    (they are returned by :meth:`reset`) but not rewrite it: the rollout already holds the prompt's tokens.
    A step's ``postprocessed_action`` and ``metadata`` land in :attr:`EnvStep.info`.
    """

    def __init__(self, env: str, *, max_turns: int | None = None, **env_config: Any) -> None:
        try:
            from omegaconf import DictConfig
        except ImportError as err:
            raise ImportError("environment 'skyrl' needs skyrl-gym: pip install 'hybridflow[agents]'") from err
        self.env_name = env
        self.max_turns = max_turns
        self.env_config = DictConfig(env_config)
        self.env: Any = None

    def _extras(self, record: EnvRecord) -> dict[str, Any]:
        columns = row_columns(record)
        reward_spec = columns.get("reward_spec")
        if not isinstance(reward_spec, Mapping) or "ground_truth" not in reward_spec:
            reward_spec = {"method": "rule", "ground_truth": str(record.ground_truth)}
        extras = {**columns, "reward_spec": dict(reward_spec), "extra_info": dict(record.extra_info)}
        if self.max_turns is not None:
            extras["max_turns"] = self.max_turns
        return extras

    def _make(self, extras: dict[str, Any]) -> Any:
        try:
            import skyrl_gym
        except ImportError as err:
            raise ImportError("environment 'skyrl' needs skyrl-gym: pip install 'hybridflow[agents]'") from err
        if ":" in self.env_name:
            env_class = load_object(self.env_name)
            env = env_class(env_config=self.env_config, extras=extras)
            if not isinstance(env, skyrl_gym.Env):
                raise TypeError(f"skyrl env {self.env_name!r} made a {type(env).__name__}, not a skyrl_gym.Env "
                                "(subclass skyrl_gym.envs.base_text_env.BaseTextEnv)")
            return env
        if self.env_name not in skyrl_gym.registry:
            raise KeyError(f"unknown skyrl-gym env {self.env_name!r}; registered: {sorted(skyrl_gym.registry)} "
                           "(or give 'path/file.py:Class')")
        return skyrl_gym.make(self.env_name, env_config=self.env_config, extras=extras)

    def reset(self, record: EnvRecord) -> list[Message]:
        prompt = ([{"role": "user", "content": record.prompt}] if isinstance(record.prompt, str)
                  else [dict(message) for message in record.prompt])
        self.env = self._make(self._extras(record))
        conversation, _ = self.env.init([dict(message) for message in prompt])
        conversation = list(conversation)
        if conversation[:len(prompt)] != prompt:
            raise ValueError(f"skyrl env {self.env_name!r} rewrote the prompt in init() (row {record.index}); only "
                             "messages appended after the row's prompt are supported, as the rollout already holds "
                             "its tokens")
        return conversation[len(prompt):]

    def step(self, turn: str) -> EnvStep:
        if self.env is None:
            raise RuntimeError(f"skyrl env {self.env_name!r}: step() before reset()")
        out = self.env.step(turn)
        info = dict(out.get("metadata") or {})
        if out.get("postprocessed_action") is not None:
            info["postprocessed_action"] = out["postprocessed_action"]
        return EnvStep(observation=[dict(message) for message in out["observations"]], reward=float(out["reward"]),
                       done=bool(out["done"]), info=info)

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None


@ENVIRONMENTS.register("trl")
class TRLEnvironment:
    """A TRL ``environment_factory`` environment: ``factory()`` builds one instance per row (:attr:`instance`).

    As TRL does: :meth:`reset` calls ``instance.reset(**row)`` with the row's columns (``prompt``,
    ``ground_truth`` and the others; only those a ``reset`` without ``**kwargs`` accepts), and a string it
    returns is shown to the model (TRL appends it to the last user message; here it is a new user message,
    since the prompt's tokens are already fixed). Every public method other than ``reset`` and ``get_reward``
    is a tool; a turn's tool calls (parsed by ``format``) run in order, each bounded by ``timeout_s``, and an
    exception becomes an error result the model sees. A turn without tool calls ends the trajectory, with
    reward ``instance.get_reward()`` when the class defines it, else 0 (reward functions can read
    :attr:`instance`, as TRL passes them ``environments=``).
    """

    def __init__(self, factory: str | Callable[[], Any], format: str | ToolCallFormat = "hermes",
                 timeout_s: float = 10.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"trl environment: timeout_s={timeout_s} must be > 0")
        make = load_object(factory) if isinstance(factory, str) else factory
        self.instance: Any = make()
        if not callable(getattr(self.instance, "reset", None)):
            raise TypeError(f"trl environment {type(self.instance).__name__} has no callable reset(); TRL's "
                            "environment_factory classes must define one")
        self.format: ToolCallFormat = TOOL_FORMATS.get(format)() if isinstance(format, str) else format
        self.timeout_s = timeout_s
        self.methods: dict[str, Callable[..., Any]] = {
            name: method for name, method in inspect.getmembers(self.instance, predicate=inspect.ismethod)
            if not name.startswith("_") and name not in TRL_RESERVED}

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tool methods' OpenAI function schemas (rendered into chat prompts)."""
        return [tool.schema() for tool in self.tools()]

    def tools(self) -> list[Tool]:
        """The tool methods as :class:`Tool` s (schemas from their type hints and Google-style docstrings, by
        ``transformers.utils.get_json_schema``, as TRL renders them), so a prompt can list them."""
        try:
            from transformers.utils import get_json_schema
        except ImportError as err:
            raise ImportError("TRLEnvironment.tools() builds tool schemas with transformers.utils.get_json_schema; "
                              "install transformers (pip install 'hybridflow[train]')") from err
        tools = []
        for name, method in self.methods.items():
            function = get_json_schema(method)["function"]
            tools.append(Tool(name=name, description=function.get("description", ""),
                              parameters=function.get("parameters", {"type": "object", "properties": {}}),
                              fn=_as_text(method), timeout_s=self.timeout_s))
        return tools

    def reset(self, record: EnvRecord) -> list[Message]:
        # TRL's multi-environment routing column is a control field it keeps out of reset()'s arguments.
        columns = {k: v for k, v in row_columns(record).items() if k != ENVIRONMENT_COLUMN}
        row = {**columns, "prompt": record.prompt, "ground_truth": str(record.ground_truth)}
        observation = self.instance.reset(**_accepted(self.instance.reset, row))
        if observation is None:
            return []
        return [{"role": "user", "content": observation if isinstance(observation, list) else str(observation)}]

    def step(self, turn: str) -> EnvStep:
        parsed = self.format.parse(turn)
        if not parsed.calls and not parsed.errors:
            get_reward = getattr(self.instance, "get_reward", None)  # may be async, as in TRL
            return EnvStep(reward=float(_call(get_reward, {})) if callable(get_reward) else 0.0, done=True)
        results = [ToolResult(call=ToolCall(name="", arguments={}), content=str({"error": error}), error=True)
                   for error in parsed.errors]
        results += [_run_method(self.methods, call, self.timeout_s) for call in parsed.calls]
        return EnvStep(observation=self.format.result_messages(results), tool_results=tuple(results),
                       info={"tool_calls": len(parsed.calls), "tool_errors": sum(r.error for r in results)})

    def close(self) -> None:
        # TRL never closes its instances (a public close() would even be one of its tools); neither do we.
        return None


def _accepted(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` that ``fn`` takes: all of them if it has ``**kwargs``, else only the names it declares."""
    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(kwargs)
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {key: value for key, value in kwargs.items() if key in names}


def _as_text(method: Callable[..., Any]) -> Callable[..., str]:
    @functools.wraps(method)
    def call(**arguments: Any) -> str:
        return str(_call(method, arguments))

    return call


def _call(method: Callable[..., Any], arguments: Mapping[str, Any]) -> Any:
    result = method(**arguments)
    return asyncio.run(result) if inspect.iscoroutine(result) else result


def _run_method(methods: Mapping[str, Callable[..., Any]], call: ToolCall, timeout_s: float) -> ToolResult:
    """One call, on its own daemon thread so a hung method costs ``timeout_s`` (and never blocks the process
    from exiting); failures become error results worded as TRL words them (``{'error': ...}``)."""
    method = methods.get(call.name)
    if method is None:
        return ToolResult(call=call, content=str({"error": f"Tool {call.name} not found. Tools: {sorted(methods)}"}),
                          error=True)
    outcome: Future[Any] = Future()

    def run() -> None:
        try:
            outcome.set_result(_call(method, call.arguments))
        except Exception as err:  # the model's call failed: it sees why, the rollout goes on
            outcome.set_exception(err)

    start = time.monotonic()
    threading.Thread(target=run, name=f"trl-tool-{call.name}", daemon=True).start()
    try:
        result = outcome.result(timeout=timeout_s)
    except FutureTimeout:
        return ToolResult(call=call, content=str({"error": f"{call.name} timed out after {timeout_s} s"}),
                          seconds=time.monotonic() - start, error=True, timed_out=True)
    except Exception as err:
        return ToolResult(call=call, content=str({"error": str(err)}), seconds=time.monotonic() - start,
                          error=True)
    return ToolResult(call=call, content=result if isinstance(result, str) else str(result),
                      seconds=time.monotonic() - start)
