"""benchmarks/judge_learning.py: the rule's marks it teaches the judge, the responses it teaches them on, and the
agreement it reports."""

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


def test_the_marks_parse_to_the_rules_reward_on_every_kind_of_response(bench: ModuleType) -> None:
    template = load_template(bench.TEMPLATE, verdict=bench.VERDICT)
    assert bench.rule_marks("cbx", "cba") == " ok ok no"
    assert bench.rule_marks("cb", "dcba") == " no no no no"
    assert bench.rule_marks("", "cba") == " no no no"
    assert bench.rule_marks(" ab ", "ab") == " ok ok"  # the rule strips the response
    assert bench.rule_marks("cbbbbb", "egceb") == " no no no no ok no"  # the first recipe's exploit, scored 1/6
    rng = random.Random(0)
    for _ in range(300):
        answer = "".join(rng.choices("abcdefgh", k=rng.randint(3, 5)))
        response = bench.corrupted(answer, rng)
        assert len(response) <= bench.MAX_CHARS
        assert template.parse(bench.rule_marks(response, answer)) == pytest.approx(char_accuracy(response, answer))


def test_the_template_lines_the_answers_up_and_fits_the_tiny_tokenizer(bench: ModuleType) -> None:
    from hybridflow.models.tokenizer import char_tokenizer

    template = load_template(bench.TEMPLATE, verdict=bench.VERDICT)
    text = template.render(prompt="rev abc=", response="cb", ground_truth="cba")
    assert text == "rev abc= pairs cc bb a. .. .. .. .. .. check:"
    tokenizer = char_tokenizer()
    assert tokenizer.unk_token_id not in tokenizer(text, add_special_tokens=False)["input_ids"]


def test_agreement_thresholds_the_score_and_counts_an_unparsed_verdict_as_a_disagreement(bench: ModuleType) -> None:
    template = load_template(bench.TEMPLATE, verdict=bench.VERDICT)
    verdicts = [" ok no", " no no ok", " ok ok", " ok verdict: correct", "correct"]
    labels = ["correct", "incorrect", "incorrect", "correct", "correct"]
    assert bench.agreement(verdicts, labels, template, 0.5) == pytest.approx(2 / 5)
    assert bench.marks_agreement(verdicts[:3], [" ok no", " no no no", " ok ok no"]) == pytest.approx(1 / 3)
    # |0.5 - 0.5| + |1/3 - 0| + |1 - 0| (the unparsed scores 0) over 3
    assert bench.score_error([" ok no", " no no ok", "ok verdict"], [0.5, 0.0, 1.0], template) == pytest.approx(
        (1 / 3 + 1) / 3)
    with pytest.raises(ValueError, match="2 verdicts for 1 rows"):
        bench.agreement(verdicts[:2], labels[:1], template, 0.5)


def test_the_corrupted_answers_span_every_quality_and_the_exploit_shapes(bench: ModuleType) -> None:
    rng = random.Random(1)
    rewards = {round(char_accuracy(bench.corrupted("abcde", rng), "abcde"), 2) for _ in range(300)}
    assert {0.0, 1.0} <= rewards and len(rewards) >= 5
    shapes = [bench.exploit_shape("egceb", rng) for _ in range(400)]
    assert any(len(set(shape)) == 1 and len(shape) >= 4 for shape in shapes)  # runs of one letter
    assert any(shape.startswith("eg") and len(set(shape[2:])) == 1 for shape in shapes)  # a run after a prefix
    assert any(sorted(shape) == sorted("egceb") and shape != "egceb" for shape in shapes)  # shuffled
    assert any(shape.startswith("egceb") and len(shape) > 5 for shape in shapes)  # padded
    assert "eeggcceebb" not in shapes and any(shape.startswith("eegg") for shape in shapes)  # doubled, cut to 8
    rows = [{"label": "correct"}] * 3 + [{"label": "incorrect"}] * 3
    shuffled = bench.judge_prompt_records(
        [{**row, "prompt": "rev abc=", "ground_truth": "cba", "response": "cba", "verdict": row["label"]}
         for row in rows], load_template(bench.TEMPLATE, verdict=bench.VERDICT), shuffle_labels_seed=0)
    assert sorted(record["ground_truth"] for record in shuffled) == ["correct"] * 3 + ["incorrect"] * 3


def test_on_policy_agreement_reads_the_runs_judge_samples_of_the_steps_asked(bench: ModuleType, tmp_path: Path) -> None:
    import json

    rows = [{"step": 0, "prompt": "rev abc=", "response": "cba", "ground_truth": "cba",
             "verdict": " ok ok ok", "score": 1.0},
            {"step": 0, "prompt": "rev abc=", "response": "xxx", "ground_truth": "cba",
             "verdict": " no ok ok", "score": 2 / 3},  # the judge fooled
            {"step": 5, "prompt": "rev abc=", "response": "xxx", "ground_truth": "cba",
             "verdict": " no no no", "score": 0.0}]
    (tmp_path / "judge_samples.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    template = load_template(bench.TEMPLATE, verdict=bench.VERDICT)
    first = bench.on_policy_agreement(tmp_path, template, 0.5, range(1))
    assert first == {"agreement": 0.5, "marks_agreement": 0.5, "score_error": pytest.approx(1 / 3)}
    assert bench.on_policy_agreement(tmp_path, template, 0.5, range(5, 10)) == {
        "agreement": 1.0, "marks_agreement": 1.0, "score_error": 0.0}
