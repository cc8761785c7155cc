"""benchmarks/judge_learning.py: the rule's verdicts it teaches the judge, and the agreement it reports."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from types import ModuleType

import pytest
from hybridflow.algorithms.judge_templates import load_template

from hybridflow.data.tasks import char_accuracy

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "judge_learning.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("judge_learning", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_rule_verdict_is_the_reward_at_the_threshold(bench: ModuleType) -> None:
    assert bench.rule_verdict("cba", "cba", 0.5) == "correct"
    assert bench.rule_verdict("cbx", "cba", 0.5) == "correct"  # 2/3 in place
    assert bench.rule_verdict("cxx", "cba", 0.5) == "incorrect"  # 1/3
    assert bench.rule_verdict("dcxx", "dcba", 0.5) == "correct"  # exactly half reaches it
    assert bench.rule_verdict("cbaxxx", "cba", 0.5) == "correct" and bench.rule_verdict("cbaxxx", "cba", 0.6) == (
        "incorrect")  # 3 of the longer 6


def test_the_worked_verdict_marks_the_positions_the_rule_compares_and_parses_to_its_label(bench: ModuleType) -> None:
    template = load_template(bench.TEMPLATE, verdict="binary")
    assert bench.worked_verdict("cbx", "cba", 0.5) == " ok ok no verdict: correct"
    assert bench.worked_verdict("cb", "dcba", 0.5) == " no no no no verdict: incorrect"
    assert bench.worked_verdict("", "cba", 0.5) == " no no no verdict: incorrect"
    assert bench.worked_verdict(" ab ", "ab", 0.5) == " ok ok verdict: correct"  # the rule strips the response
    rng = random.Random(0)
    for _ in range(200):
        answer = "".join(rng.choices("abcdefgh", k=rng.randint(3, 5)))
        response = bench.corrupted(answer, rng)
        marks = bench.worked_verdict(response, answer, 0.5).split(" verdict: ")[0].split()
        assert marks.count("ok") / len(marks) == pytest.approx(char_accuracy(response, answer))
        label = bench.rule_verdict(response, answer, 0.5)
        assert template.parse(bench.worked_verdict(response, answer, 0.5)) == (1.0 if label == "correct" else 0.0)


def test_the_template_lines_the_answers_up_and_fits_the_tiny_tokenizer(bench: ModuleType) -> None:
    from hybridflow.models.tokenizer import char_tokenizer

    text = load_template(bench.TEMPLATE, verdict="binary").render(prompt="rev abc=", response="cb", ground_truth="cba")
    assert text == "rev abc= pairs cc bb a. .. .. .. .. .. check:"
    tokenizer = char_tokenizer()
    assert tokenizer.unk_token_id not in tokenizer(text, add_special_tokens=False)["input_ids"]


def test_agreement_counts_an_unparsed_verdict_as_a_disagreement(bench: ModuleType) -> None:
    template = load_template(bench.TEMPLATE, verdict="binary")
    verdicts = [" ok verdict: correct", " no verdict: incorrect", " ok verdict: incorrect", " ok verdict:", "correct"]
    labels = ["correct", "incorrect", "correct", "correct", "correct"]
    assert bench.agreement(verdicts, labels, template) == pytest.approx(3 / 5)
    with pytest.raises(ValueError, match="2 verdicts for 1 labels"):
        bench.agreement(verdicts[:2], labels[:1], template)


def test_the_corrupted_answers_span_every_quality_and_the_rows_are_balanced(bench: ModuleType) -> None:
    rng = random.Random(1)
    rewards = {round(char_accuracy(bench.corrupted("abcde", rng), "abcde"), 2) for _ in range(300)}
    assert {0.0, 1.0} <= rewards and len(rewards) >= 5
    rows = [{"label": "correct"}] * 3 + [{"label": "incorrect"}] * 3
    shuffled = bench.judge_prompt_records(
        [{**row, "prompt": "rev abc=", "ground_truth": "cba", "response": "cba", "verdict": row["label"]}
         for row in rows], load_template(bench.TEMPLATE, verdict="binary"), shuffle_labels_seed=0)
    assert sorted(record["ground_truth"] for record in shuffled) == ["correct"] * 3 + ["incorrect"] * 3


def test_on_policy_agreement_reads_the_runs_judge_samples_of_the_steps_asked(bench: ModuleType, tmp_path: Path) -> None:
    import json

    rows = [{"step": 0, "prompt": "rev abc=", "response": "cba", "ground_truth": "cba",
             "verdict": " ok ok ok verdict: correct", "score": 1.0},
            {"step": 0, "prompt": "rev abc=", "response": "xxx", "ground_truth": "cba",
             "verdict": " no no no verdict: correct", "score": 1.0},  # the judge fooled
            {"step": 5, "prompt": "rev abc=", "response": "xxx", "ground_truth": "cba",
             "verdict": " no no no verdict: incorrect", "score": 0.0}]
    (tmp_path / "judge_samples.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    template = load_template(bench.TEMPLATE, verdict="binary")
    assert bench.on_policy_agreement(tmp_path, template, 0.5, range(1)) == pytest.approx(0.5)
    assert bench.on_policy_agreement(tmp_path, template, 0.5, range(5, 10)) == 1.0
