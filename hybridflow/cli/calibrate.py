"""``hybridflow calibrate``: fit the planner's efficiency constants to measured runs, write a calibration file.

Inputs: ``--published FILE`` (records in the format of ``published_runs.json``; a record's
``hybridflow`` mapping states what the record leaves out) and/or ``--run DIR[=PLAN_CONFIG]``
(a ``hybridflow train`` run directory with ``plan.json`` and ``metrics.jsonl``; its planner inputs come
from the run's own ``config.json`` as ``hybridflow train`` planned it, with the padding and token budgets of its
``plan.json`` and the response lengths of its ``metrics.jsonl``, or from a ``hybridflow plan --config`` YAML,
``PLAN_CONFIG`` or ``DIR/plan_inputs.yaml`` when there is one). Prints each case's worst
predicted/measured ratio before and after and the constants held at their starting values (``--hold``,
default ``fit.HELD``: constants such runs do not constrain), writes ``--out`` for ``hybridflow plan --calibration``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from hybridflow.files import read_json, read_yaml
from hybridflow.planner.calibration import FORMAT, Calibration
from hybridflow.planner.fit import FITTED, HELD, describe, fit_calibration, loss
from hybridflow.planner.published import MeasuredCase, case_from_record


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("calibrate", help="fit the planner's cost constants to measured runs")
    parser.add_argument("--published", action="append", default=[], metavar="FILE",
                        help="a JSON list of published runs (format of published_runs.json); repeatable")
    parser.add_argument("--run", action="append", default=[], metavar="DIR[=PLAN_CONFIG]", dest="runs",
                        help="a hybridflow train run directory; PLAN_CONFIG (a `hybridflow plan --config` YAML "
                             "with its cluster, models and workload) defaults to DIR/plan_inputs.yaml")
    parser.add_argument("--skip-steps", type=int, default=1, help="warm-up steps of a run to ignore (default 1)")
    parser.add_argument("--prompt-len", type=int, default=None,
                        help="mean prompt tokens of the --run directories costed from their config.json (default: "
                             "the config's data.max_prompt_length)")
    parser.add_argument("--fit", default=",".join(FITTED), help=f"constants to fit (default {','.join(FITTED)})")
    parser.add_argument("--hold", default=",".join(HELD),
                        help=f"constants kept at their starting values, not fitted: ones the runs cannot constrain "
                             f"(default {','.join(HELD)}; '' fits every --fit constant)")
    parser.add_argument("--per-device", action="store_true",
                        help="also fit constants per device class with at least 3 cases")
    parser.add_argument("--start", help="a calibration file to start from (default: the priors)")
    parser.add_argument("--out", required=True, help="where to write the calibration file")
    parser.set_defaults(run=run)


def _published_cases(path: str) -> list[MeasuredCase]:
    records = read_json(path, what="--published")
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a JSON list of run records")
    cases = [case_from_record(record) for record in records]
    return [case for case in cases if case.measured]


def case_from_run_dir(folder: Path, skip_steps: int, prompt_len: int | None) -> MeasuredCase:
    """A `hybridflow train` run directory costed with the planner inputs its training planned with
    (``train.placement``), the run's executed padding, budgets and response lengths (``settings_as_run``)."""
    from hybridflow.planner.measured import case_from_run, settings_as_run
    from hybridflow.planner.plan import Plan
    from hybridflow.train import placement, setup
    from hybridflow.train.config import load_config
    from hybridflow.train.template_tokens import template_tokens

    config = load_config(folder / "config.json")
    prompt = prompt_len or config.data.max_prompt_length
    if not prompt:
        raise ValueError(f"--run {folder}: its config sets no data.max_prompt_length; pass --prompt-len (the mean "
                         "prompt tokens of its data)")
    graph = setup.build_graph(config)
    plan = Plan.from_json((folder / "plan.json").read_text())
    settings = settings_as_run(plan, placement.run_settings(config, graph), folder / "metrics.jsonl")
    final = folder / "final"
    models = placement.role_models(config, graph, str(final) if (final / "config.json").is_file() else None)
    extra = template_tokens(config, graph, setup.policy_tokenizer(config), setup.records(config))
    work = placement.workload(config, graph, prompt, settings, template_tokens=extra)
    return case_from_run(folder, graph=graph, models=models, workload=work, cluster=placement.planner_cluster(config),
                         settings=settings, skip_steps=skip_steps)


def _run_case(spec: str, skip_steps: int, prompt_len: int | None = None) -> MeasuredCase:
    from hybridflow.cli.plan import _models, build_cluster, run_settings
    from hybridflow.graph import Workload, load_graph
    from hybridflow.graph.loading import takes_option
    from hybridflow.planner.measured import case_from_run

    folder, sep, config = spec.partition("=")
    config_path = Path(config) if sep else Path(folder) / "plan_inputs.yaml"
    if not sep and not config_path.is_file() and (Path(folder) / "config.json").is_file():
        return case_from_run_dir(Path(folder), skip_steps, prompt_len)
    if not config_path.is_file():
        raise FileNotFoundError(f"--run {spec}: no planner inputs: neither {Path(folder) / 'config.json'} (a "
                                f"`hybridflow train` run directory) nor {config_path}; pass a run directory or write "
                                "a `hybridflow plan --config` YAML (cluster, models, batch_size, prompt_len...)")
    options = read_yaml(config_path, what=f"--run {spec}: planner inputs") or {}
    if not isinstance(options, dict) or "cluster" not in options:
        raise ValueError(f"{config_path}: needs at least 'cluster' and 'models' keys")
    name = str(options.get("algorithm", "ppo"))
    kind = {"reward_kind": options.get("reward_kind", "reward_model")} if takes_option(name, "reward_kind") else {}
    graph = load_graph(name, **kind)
    gpu_roles = [role.name for role in graph.roles if role.kind.needs_gpu]
    given = {str(k): str(v) for k, v in (options.get("models") or {}).items()}
    models = _models(graph.role_names, gpu_roles, given,
                     {role: f"{config_path}: models.{role}={model}" for role, model in given.items()})
    workload = Workload(batch_size=int(options.get("batch_size", 1024)), prompt_len=int(options.get("prompt_len", 512)),
                        response_len=int(options.get("response_len", 512)), n_samples=options.get("n_samples"))
    return case_from_run(folder, graph=graph, models=models, workload=workload, cluster=build_cluster(options),
                         settings=run_settings(options, workload.response_len), skip_steps=skip_steps)


def run(args: argparse.Namespace) -> int:
    _check_out(Path(args.out))
    cases = [case for path in args.published for case in _published_cases(path)]
    cases += [_run_case(spec, args.skip_steps, args.prompt_len) for spec in args.runs]
    if not cases:
        raise ValueError("nothing to calibrate on: give --published FILE or --run DIR")
    held = [name.strip() for name in str(args.hold).split(",") if name.strip()]
    names = [name.strip() for name in str(args.fit).split(",") if name.strip() and name.strip() not in held]
    start = Calibration.load(args.start) if args.start else Calibration()
    pairs = [(case.predict, case.measured) for case in cases]
    fitted = fit_calibration(pairs, names=names, held=held, start=start.default,
                             source=f"hybridflow calibrate ({len(cases)} cases)",
                             devices=[case.device for case in cases] if args.per_device else None)
    print(f"{'case':<60} {'worst ratio before':>20} {'after':>10}")
    for case in cases:
        print(f"{case.id[:60]:<60} {case.worst_ratio(start):>19.2f}x {case.worst_ratio(fitted):>9.2f}x")
    print(f"mean squared log error: {loss(pairs, start):.4f} before, {loss(pairs, fitted):.4f} after")
    print(f"fitted: {describe(fitted.default, names)}")
    if held:
        print(f"held at {'--start' if args.start else 'the priors'} (not fitted): {describe(fitted.default, held)}")
    for device, constants in fitted.devices:
        print(f"  {device}: {describe(constants, names)}")
    fitted.save(args.out)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _check_out(out: Path) -> None:
    """``--out`` may replace a calibration file, never another file or a directory."""
    if out.is_dir():
        raise ValueError(f"--out {out}: a directory; give the path of the calibration file to write")
    if out.exists():
        try:
            written = read_json(out).get("format") == FORMAT
        except (ValueError, AttributeError):
            written = False
        if not written:
            raise ValueError(f"--out {out}: exists and is not a calibration file; refusing to replace it: choose "
                             "another path")
