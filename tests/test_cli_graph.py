"""``hybridflow graph``: validate and render built-in and user algorithms from the command line."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.graph import FORMATS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "my_algorithm.py"


def test_graph_json_lists_every_ppo_op(capsys):
    assert main(["graph", "ppo", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    ops = {node["op"] for node in data["nodes"]}
    assert ops == {"generate", "score", "ref_logprob", "values", "logprob", "compute", "update"}
    for node in data["nodes"]:
        assert set(node) >= {"name", "op", "role", "inputs", "outputs"}
    assert all(set(edge) == {"src", "dst", "fields"} for edge in data["edges"])


def test_unknown_algorithm_lists_valid_names(capsys):
    assert main(["graph", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown algorithm 'nope'" in err and "grpo" in err


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ["ppo", "grpo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline"])
def test_every_builtin_renders_in_every_format(capsys, name, fmt):
    assert main(["graph", name, "--format", fmt]) == 0
    out = capsys.readouterr().out
    assert "actor_update" in out


def test_the_example_algorithm_renders_and_validates_from_its_file(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the path as the README writes it
    assert main(["graph", "examples/my_algorithm.py:critic_grpo", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    roles = {r["name"]: r["kind"] for r in data["roles"]}
    assert roles["critic"] == "value" and roles["reward"] == "reward_function"
    gae = next(n for n in data["nodes"] if n["name"] == "advantages")
    assert gae["fn"] == "gae" and gae["options"] == {"gamma": 1.0, "lam": 1.0}
    actor = next(n for n in data["nodes"] if n["name"] == "actor_update")
    assert {"ref_logprobs", "advantages"} <= set(actor["inputs"]) and actor["options"]["kl_coef"] > 0
    assert main(["graph", f"{EXAMPLE}:critic_grpo", "--format", "mermaid"]) == 0
    assert capsys.readouterr().out.startswith("flowchart TD")


def test_the_example_is_at_most_fifteen_lines_of_graph_code_and_the_readme_shows_it():
    source = EXAMPLE.read_text()
    function = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef))
    body = source.splitlines()[function.body[0].lineno - 1 : function.end_lineno]
    assert len(body) <= 15
    readme = (ROOT / "README.md").read_text()
    assert "\n".join(source.splitlines()[function.lineno - 1 : function.end_lineno]) in readme
    assert "hybridflow graph examples/my_algorithm.py:critic_grpo" in readme


def test_an_invalid_user_graph_exits_2_naming_node_and_field(tmp_path, capsys):
    path = tmp_path / "broken.py"
    path.write_text(
        "from hybridflow.graph import GraphBuilder\n"
        "def algo():\n"
        "    g = GraphBuilder('broken')\n"
        "    actor = g.role('actor', 'policy')\n"
        "    g.generate(actor)\n"
        "    g.compute('adv', fn='gae', inputs=('scores',), outputs=('advantages',))\n"
        "    g.update(actor, loss='ppo_policy', inputs=('advantages',))\n"
        "    return g.build()\n"
    )
    assert main(["graph", f"{path}:algo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridflow graph: error: ") and "'adv'" in err and "'scores'" in err


@pytest.mark.parametrize(("spec", "message"), [("missing.py:algo", "no file"), ("json:nope", "no attribute 'nope'")])
def test_bad_user_paths_exit_2_with_the_reason(tmp_path, capsys, monkeypatch, spec, message):
    monkeypatch.chdir(tmp_path)
    assert main(["graph", spec]) == 2
    assert message in capsys.readouterr().err


def test_an_unknown_format_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["graph", "ppo", "--format", "svg"])
    assert info.value.code == 2
    assert "invalid choice: 'svg'" in capsys.readouterr().err
