import json

from hybridflow.cli import main


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
