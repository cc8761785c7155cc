"""``hybridflow graph NAME|file.py:function``: validate an algorithm and render it."""

from __future__ import annotations

import argparse
from typing import Any

import yaml

from hybridflow.graph import FORMATS, Graph, RoleKind, load_graph, render, with_detached_logprobs


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("graph", help="validate and render an algorithm's dataflow graph")
    parser.add_argument("algorithm", help="a built-in name (ppo, grpo, ...) or path/to/file.py:function")
    parser.add_argument("--format", choices=FORMATS, default="text")
    parser.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                        help="an algorithm option (value read as YAML), e.g. -o kl_coef=0; repeatable")
    parser.add_argument("--single-pass", action="store_true",
                        help="show the graph `hybridflow train` runs for a synchronous single-pass update "
                             "(skip_known_passes, optim.actor.epochs 1, optim.actor.mini_batches 1, the defaults): the "
                             "policy's old log-probs come from its update's own forward")
    parser.set_defaults(run=run)


def algorithm_options(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as options, each value parsed as YAML (``0`` an int, ``0.04`` a float...)."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"hybridflow graph: --option {pair!r} must be KEY=VALUE, e.g. kl_coef=0")
        options[key] = yaml.safe_load(value)
    return options


def single_pass(graph: Graph) -> Graph:
    return with_detached_logprobs(graph, {role.name for role in graph.roles if role.kind is RoleKind.POLICY})


def run(args: argparse.Namespace) -> int:
    graph = load_graph(args.algorithm, **algorithm_options(args.option))
    print(render(single_pass(graph) if args.single_pass else graph, args.format))
    return 0
