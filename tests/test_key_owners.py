"""One owner per name: no layer below the config (``train/``, ``cli/``, ``classic/``) spells a config key.

A lower layer names its own fields (``hybridflow.fields.FieldError``) and the config layer spells them as the
user's keys once (``hybridflow.train.schema``). Every string a module builds (messages, log lines; docstrings
and comments are documentation, not checked) is parsed, never run.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ABOVE = ("hybridflow/train", "hybridflow/cli", "hybridflow/classic")  # the layers that own the user's spelling
SECTIONS = ("model", "data", "actor", "critic", "roles", "agent", "placement", "pipeline", "executor",
            "checkpoint", "validation", "logging", "algorithm.options")
KEY = re.compile(r"config key|\b(?:" + "|".join(SECTIONS[1:]) + r")\.(?:[a-z_]+|\{|<)")


def _lower_modules() -> list[Path]:
    files = [*(ROOT / "hybridflow").rglob("*.py"), *(ROOT / "backends").rglob("*.py"),
             *(ROOT / "algorithms").rglob("*.py")]
    return sorted(p for p in files if not str(p.relative_to(ROOT)).startswith(ABOVE))


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value,
                                                                                              ast.Constant):
            found.add(id(body[0].value))
    return found


def _strings(path: Path) -> Iterator[tuple[int, str]]:
    """Each string literal of ``path`` (an f-string's literal parts joined) that is not a docstring."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _docstrings(tree)
    parts_of_fstrings = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            yield node.lineno, text
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
              and id(node) not in parts_of_fstrings):
            yield node.lineno, node.value


def test_the_pattern_finds_a_config_key() -> None:
    assert KEY.search("set data.answer_key to the column") and KEY.search("config key 'padding'")
    assert KEY.search("set roles.{} lora") and not KEY.search("model.config.hidden_size")


@pytest.mark.parametrize("path", _lower_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_lower_layer_spells_a_config_key(path: Path) -> None:
    spelled = [f"{path.relative_to(ROOT)}:{line}: {text!r}" for line, text in _strings(path) if KEY.search(text)]
    assert not spelled, "a config key spelled below the config layer (raise FieldError naming the field):\n" + \
        "\n".join(spelled)


def test_each_default_has_one_source() -> None:
    """The agent's turn bound, its schedules and the sampling temperature are defined once, in the graph layer
    (the lowest that reads them), and every layer above takes them from there."""
    import dataclasses
    import inspect
    import typing

    from hybridflow.algorithms import graphs

    from hybridflow.agents.loop import SCHEDULES, AgentSettings
    from hybridflow.graph.node import AGENT_SCHEDULES, DEFAULT_MAX_TURNS, DEFAULT_TEMPERATURE
    from hybridflow.planner import execution
    from hybridflow.runtime.specs import SamplingParams
    from hybridflow.train.config import AgentConfig

    assert SCHEDULES is AGENT_SCHEDULES and execution.AGENT_SCHEDULES is AGENT_SCHEDULES
    assert typing.get_args(typing.get_type_hints(AgentConfig)["schedule"]) == (*AGENT_SCHEDULES, "auto")
    assert AgentConfig().max_turns == AgentSettings().max_turns == DEFAULT_MAX_TURNS
    assert {f.default for f in dataclasses.fields(SamplingParams) if f.name == "temperature"} == {DEFAULT_TEMPERATURE}
    builders = [fn for name, fn in vars(graphs).items() if inspect.isfunction(fn) and fn.__module__ == graphs.__name__]
    temperatures = {inspect.signature(fn).parameters["temperature"].default for fn in builders
                    if "temperature" in inspect.signature(fn).parameters} - {inspect.Parameter.empty}
    assert temperatures == {DEFAULT_TEMPERATURE}
