"""An LLM judge as a graph: templates and their refusals, strict verdict parsing, the ``grpo_judge`` graph and the
user's file that writes it, the judge's driver functions on real tokenizers, and a tiny CPU run whose random judge
answers nothing parseable (each verdict scored ``unparsed_score`` and counted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hybridflow.algorithms.judge_templates import load_template, parse_binary, parse_marks, parse_rubric, parse_score

from hybridflow.graph import Graph, GraphBuilder, NodeSpecError, RoleKind, load_graph
from hybridflow.models import build_tiny_causal_lm, save_model_dir
from hybridflow.models.tokenizer import WIDE_ALPHABET, char_tokenizer
from hybridflow.registry import COMPUTE_FNS
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.dispatch import node_inputs
from hybridflow.runtime.worker import port_batch

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["logging.progress=false", "logging.plot=false", "checkpoint.every=0", "logging.trackers=[jsonl]"]


def test_the_builtin_templates_render_their_fields() -> None:
    pointwise = load_template("pointwise").render(prompt="rev abc=", response="cba")
    assert "rev abc=" in pointwise and "cba" in pointwise and "0 to 10" in pointwise
    reference = load_template("reference")
    assert reference.fields == {"prompt", "response", "ground_truth"}
    assert "the truth" in reference.render(prompt="p", response="r", ground_truth="the truth")
    rubric = load_template("rubric", rubric="is correct=2; is concise").render(prompt="p", response="r")
    assert "1. is correct" in rubric and "2. is concise" in rubric
    assert "0 to 5" in load_template("pointwise", scale=5).render(prompt="p", response="r")


def test_a_users_template_is_jinja_text_or_a_file(tmp_path: Path) -> None:
    text = "Q: {{ prompt }} A: {{ response }} Score: ?"
    assert load_template(text).render(prompt="q", response="a") == "Q: q A: a Score: ?"
    path = tmp_path / "judge.j2"
    path.write_text("{{ response }} vs {{ ground_truth }}")
    template = load_template(str(path), verdict="binary")
    assert template.render(prompt="", response="a", ground_truth="b") == "a vs b"
    assert template.parse("Verdict: correct") == 1.0


@pytest.mark.parametrize(("template", "options", "named"), [
    ("{{ prompt }} {{ answer }}", {}, "names field 'answer'"),
    ("{{ response }} {% if reference %}x{% endif %}", {}, "names field 'reference'"),
    ("no/such/template.j2", {}, "judge_template='no/such/template.j2' is no built-in"),
    ("{{ response", {}, "Jinja syntax error"),
    ("pointwise", {"verdict": "binary"}, "judge_verdict='binary' does not fit"),
    ("{{ response }}", {"verdict": "stars"}, "judge_verdict='stars' must be one of"),
    ("rubric", {}, "judge_rubric must list the criteria"),
    ("rubric", {"rubric": "correct=-1"}, "criterion 'correct=-1'"),
    ("pointwise", {"scale": 0}, "judge_scale=0"),
])
def test_a_bad_template_is_refused_in_one_line_naming_it(template: str, options: dict[str, object],
                                                         named: str) -> None:
    with pytest.raises(ValueError, match="algorithm option judge_") as info:
        load_template(template, **options)  # type: ignore[arg-type]
    assert named in str(info.value) and "\n" not in str(info.value)


def test_the_graph_refuses_a_template_with_a_missing_field_when_built() -> None:
    with pytest.raises(ValueError, match="names field 'answer'"):
        load_graph("grpo_judge", judge_template="{{ response }} {{ answer }}")


@pytest.mark.parametrize(("verdict", "score"), [
    ("Score: 7", 0.7), ("score=10", 1.0), ("SCORE: 0", 0.0), ("7", 0.7), ("7/10", 0.7), (" 3.5 ", 0.35),
    ("The response reverses the string. Score: 8.", 0.8), ("Score: 9/10", 0.9), ("Score: 4\nScore: 4", 0.4),
    ("Score: 11", None), ("Score: -1", None), ("Score: 7/5", None), ("Score: 3\nScore: 4", None), ("", None),
    ("\n\n\n", None), ("garbage", None), ("It is a 7 out of 10", None), ("Score: seven", None), ("7 8", None),
])
def test_a_score_verdict_parses_strictly(verdict: str, score: float | None) -> None:
    assert parse_score(verdict) == (None if score is None else pytest.approx(score))


@pytest.mark.parametrize(("verdict", "score"), [
    ("Verdict: correct", 1.0), ("verdict: INCORRECT", 0.0), ("correct", 1.0), ("**Incorrect**.", 0.0),
    ("Reasoning... Verdict: correct", 1.0), ("Verdict: correct\nVerdict: incorrect", None),
    ("the response is correct", None), ("", None), ("Verdict: maybe", None), ("correctness", None),
])
def test_a_binary_verdict_parses_strictly(verdict: str, score: float | None) -> None:
    assert parse_binary(verdict) == score


@pytest.mark.parametrize(("verdict", "score"), [
    ("1: yes\n2: no", 2 / 3), ("1. no\n2) yes", 1 / 3), ("- 1: YES\n- 2: yes", 1.0), ("1: yes", None),
    ("1: yes\n2: no\n3: yes", None), ("1: yes\n1: no\n2: yes", None), ("", None), ("yes yes", None),
])
def test_a_rubric_verdict_parses_strictly(verdict: str, score: float | None) -> None:
    assert parse_rubric(verdict, (2.0, 1.0)) == (None if score is None else pytest.approx(score))


@pytest.mark.parametrize(("verdict", "score"), [
    (" ok ok no", 2 / 3), ("OK, no", 0.5), ("ok\nno\nok.", 2 / 3), ("no", 0.0), ("ok ok ok ok ok ok ok ok", 1.0),
    ("", None), ("  ", None), ("okno", None), ("nook", None), ("ok ok maybe", None), ("ok verdict: correct", None),
    ("ok,,no", None), ("ok. no", None), ("2: ok", None),
])
def test_a_marks_verdict_parses_strictly(verdict: str, score: float | None) -> None:
    assert parse_marks(verdict) == (None if score is None else pytest.approx(score))


def test_a_users_template_can_be_scored_by_its_marks() -> None:
    template = load_template("{{ ground_truth }} {{ response }} check:", verdict="marks")
    assert template.verdict == "marks" and template.parse(" ok no no no") == 0.25
    assert template.parse(" ok no verdict: correct") is None


def _shape(graph: Graph) -> tuple[set[tuple[str, str, str | None]], set[tuple[str, str]], dict[str, RoleKind]]:
    nodes = {(node.name, str(node.op), node.role) for node in graph.nodes}
    return nodes, {(edge.src, edge.dst) for edge in graph.edges}, {role.name: role.kind for role in graph.roles}


def test_the_grpo_judge_graph_samples_judges_then_updates() -> None:
    graph = load_graph("grpo_judge", kl_coef=0.0, judge_max_new_tokens=24)
    assert graph.role("judge").kind is RoleKind.FROZEN_POLICY and "reward" not in graph.role_names
    judge = graph.node("judge_generate")
    assert judge.inputs == ("judge_prompts",) and judge.samples_per_prompt == 1
    assert judge.option("greedy") is True and judge.max_new_tokens == 24
    assert graph.producers["scores"] == "judge" and graph.node("judge").fn == "judge_scores"
    order = graph.order
    assert order.index("actor_generate") < order.index("judge_prompts") < order.index("judge_generate") \
        < order.index("judge") < order.index("advantages") < order.index("actor_update")
    assert graph.samples_per_prompt == 4
    sampled = load_graph("grpo_judge", judge_temperature=0.7).node("judge_generate")
    assert sampled.option("temperature") == 0.7 and sampled.option("greedy") is None


def test_the_users_example_file_builds_the_same_graph_shape() -> None:
    builtin = load_graph("grpo_judge", kl_coef=0.0)
    users = load_graph(f"{ROOT / 'examples' / 'llm_judge.py'}:judged_grpo")
    assert _shape(users)[1:] == _shape(builtin)[1:]
    assert {(op, role) for _, op, role in _shape(users)[0]} == {(op, role) for _, op, role in _shape(builtin)[0]}
    graph_lines = (ROOT / "examples" / "llm_judge.py").read_text().split("def judged_grpo")[1].splitlines()
    assert len(graph_lines) <= 25


def test_a_generate_from_computed_prompts_answers_each_row_once() -> None:
    g = GraphBuilder("bad")
    actor, judge = g.role("actor", RoleKind.POLICY), g.role("judge", RoleKind.FROZEN_POLICY)
    g.generate(actor, n=4)
    g.compute("render", fn="judge_prompts", inputs=("prompts", "responses", "response_mask", "ground_truth"),
              outputs=("judge_prompts", "judge_prompts_mask"))
    g.generate(judge, n=4, inputs=("judge_prompts",), outputs=("verdict_ids", "verdict_mask"))
    g.compute("judge", fn="judge_scores", inputs=("verdict_ids", "verdict_mask"), outputs=("scores", "verdicts"))
    g.compute("advantages", fn="grpo_advantages", inputs=("scores", "response_mask", "uid"), outputs=("advantages",))
    g.update(actor, loss="ppo_policy", inputs=("prompts", "responses", "response_mask", "advantages"))
    with pytest.raises(NodeSpecError, match=r"'judge_generate' generates from 'judge_prompts'.*n=4 must be 1"):
        g.build()


def test_the_judges_generate_reads_its_computed_prompts_and_their_mask() -> None:
    node = load_graph("grpo_judge").node("judge_generate")
    rows = Batch({"judge_prompts": torch.ones(2, 3, dtype=torch.long), "judge_prompts_mask": torch.ones(2, 3),
                  "prompts": torch.zeros(2, 5), "prompt_mask": torch.zeros(2, 5)})
    ported = port_batch(node, rows)
    assert sorted(ported.keys()) == ["prompt_mask", "prompts"] and ported["prompts"].shape == (2, 3)
    assert node_inputs(node, rows) == ["judge_prompts", "judge_prompts_mask"]  # what the judge's group is sent
    actor = load_graph("grpo_judge").node("actor_generate")
    assert node_inputs(actor, rows) == ["prompts", "prompt_mask"]


def _state(fn: str, options: dict[str, object], models: dict[str, str]) -> object:
    return COMPUTE_FNS.get(fn).make_state(**options, role_models=models)  # type: ignore[attr-defined]


def test_the_judges_functions_render_in_the_judges_tokens_and_parse_its_verdicts(tmp_path: Path) -> None:
    policy = char_tokenizer()
    judge_dir = save_model_dir(build_tiny_causal_lm("tiny-qwen2", vocab_size=len(char_tokenizer(WIDE_ALPHABET))),
                               char_tokenizer(WIDE_ALPHABET), tmp_path / "judge")
    models, options = {"actor": "tiny-qwen2", "judge": str(judge_dir)}, {"template": "reference"}
    prompts = policy(["rev ab=", "rev abc="], padding=True, padding_side="left", return_tensors="pt")["input_ids"]
    responses = policy(["ba", "cab"], padding=True, return_tensors="pt")["input_ids"]
    mask = (responses != policy.pad_token_id).long()
    state = _state("judge_prompts", options, models)
    ids, ids_mask = COMPUTE_FNS.get("judge_prompts")(prompts, responses, mask, ["ba", "cba"], state=state, **options)
    judge = char_tokenizer(WIDE_ALPHABET)
    texts = [judge.decode(row[m.bool()].tolist()) for row, m in zip(ids, ids_mask, strict=True)]
    assert "Task:\nrev abc=\n" in texts[1] and "Reference answer:\ncba" in texts[1] and "Response:\ncab" in texts[1]
    assert bool(ids_mask[:, -1].all())  # left-padded: every row continues at its end
    with pytest.raises(ValueError, match="reads field 'ground_truth'"):
        COMPUTE_FNS.get("judge_prompts")(prompts, responses, mask, ["ba", ""], state=state, **options)

    verdicts = judge(["Verdict: correct", "I think so"], padding=True, return_tensors="pt")["input_ids"]
    verdict_mask = (verdicts != judge.pad_token_id).long()
    kept = _state("judge_scores", options, models)
    scores, text = COMPUTE_FNS.get("judge_scores")(verdicts, verdict_mask, unparsed_score=0.25, state=kept, **options)
    assert scores.tolist() == [1.0, 0.25] and text == ["Verdict: correct", "I think so"]
    assert kept.metrics() == {"unparsed": 1.0, "unparsed_frac": 0.5}  # type: ignore[attr-defined]


def test_a_marks_judge_scores_the_share_of_pass_marks_and_counts_the_unparsed(tmp_path: Path) -> None:
    tokenizer = char_tokenizer()
    judge_dir = save_model_dir(build_tiny_causal_lm("tiny-qwen2", vocab_size=len(tokenizer)), tokenizer,
                               tmp_path / "judge")
    models = {"actor": "tiny-qwen2", "judge": str(judge_dir)}
    options = {"template": "{{ ground_truth }} {{ response }} check:", "verdict": "marks"}
    verdicts = tokenizer([" ok ok no no", " ok ok ok", " ok no verdict: correct"], padding=True,
                         return_tensors="pt")["input_ids"]
    kept = _state("judge_scores", options, models)
    scores, _ = COMPUTE_FNS.get("judge_scores")(verdicts, (verdicts != tokenizer.pad_token_id).long(),
                                                unparsed_score=0.0, state=kept, **options)
    assert scores.tolist() == [0.5, 1.0, 0.0]
    assert kept.metrics() == {"unparsed": 1.0, "unparsed_frac": pytest.approx(1 / 3)}  # type: ignore[attr-defined]


def test_a_judge_of_another_tokenizer_is_not_refused(tmp_path: Path) -> None:
    from hybridflow.train.config import load_config
    from hybridflow.train.role_tokenizers import check_role_tokenizers

    wide = char_tokenizer(WIDE_ALPHABET)
    judge = save_model_dir(build_tiny_causal_lm("tiny-qwen2", vocab_size=len(wide)), wide, tmp_path / "judge")
    config = load_config(ROOT / "configs" / "grpo_judge.yaml", [f"roles.judge.model={judge}"])
    check_role_tokenizers(config, load_graph("grpo_judge"), char_tokenizer(), ["rev abc="])


@pytest.mark.parametrize(("options", "named"), [({"unparsed_score": 2.0}, "unparsed_score=2.0"),
                                                ({"judge_max_new_tokens": 0}, "judge_max_new_tokens=0"),
                                                ({"judge_temperature": -1.0}, "judge_temperature=-1.0")])
def test_bad_judge_options_are_named(options: dict[str, float], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        load_graph("grpo_judge", **options)


@pytest.mark.slow
def test_a_tiny_cpu_run_with_a_random_judge_completes_and_counts_what_it_cannot_parse(tmp_path: Path) -> None:
    from hybridflow.train.config import load_config
    from hybridflow.train.loop import train

    wide = char_tokenizer(WIDE_ALPHABET)
    judge = save_model_dir(build_tiny_causal_lm("tiny-qwen2", vocab_size=len(wide), seed=3), wide, tmp_path / "judge")
    config = load_config(ROOT / "configs" / "grpo_judge.yaml", [
        "algorithm.options={n: 2, kl_coef: 0.0, max_new_tokens: 6, judge_max_new_tokens: 4, unparsed_score: 0.5}",
        "steps=2", "data.batch_size=4", "data.num_examples=32", "model.sft_steps=2", f"roles.judge.model={judge}",
        f"output_dir={tmp_path / 'run'}", *QUIET])
    history = train(config).history
    assert [row["step"] for row in history] == [0, 1]
    for row in history:
        assert 0 <= row["judge/unparsed"] <= 8 and row["judge/unparsed_frac"] == row["judge/unparsed"] / 8
        assert 0.0 <= row["reward/mean"] <= 1.0
    judged = [json.loads(line) for line in (tmp_path / "run" / "judge_samples.jsonl").read_text().splitlines()]
    assert {row["step"] for row in judged} == {0, 1} and all(0.0 <= row["score"] <= 1.0 for row in judged)
    assert all({"prompt", "response", "verdict", "score"} <= set(row) for row in judged)
    unparsed = [row for row in judged if parse_score(row["verdict"]) is None]
    assert unparsed and all(row["score"] == 0.5 for row in unparsed)  # a random judge answers no score
    assert history[0]["judge/unparsed"] >= len([row for row in unparsed if row["step"] == 0])


@pytest.mark.slow
def test_a_judge_taught_one_verdict_scores_every_sample_with_it(tmp_path: Path) -> None:
    """The verdicts the judge's role generates reach the parser intact: a tiny judge fine-tuned to answer
    ``Score: 7`` to the pointwise template scores every sampled response 0.7, none unparsed."""
    import random

    from hybridflow.train.config import load_config
    from hybridflow.train.loop import train
    from hybridflow.train.sft import sft_warm_start

    wide, template, rng = char_tokenizer(WIDE_ALPHABET), load_template("pointwise"), random.Random(0)
    records = [{"prompt": template.render(prompt=f"rev {''.join(rng.choices('abcdefgh', k=rng.randint(3, 5)))}=",
                                          response="".join(rng.choices("abcdefgh0123 ", k=rng.randint(0, 6)))),
                "ground_truth": "Score: 7"} for _ in range(128)]
    model = build_tiny_causal_lm("tiny-qwen2", vocab_size=len(wide), seed=3)
    sft_warm_start(model, wide, records, steps=25, batch_size=16, lr=3e-3, seed=0)
    judge = save_model_dir(model, wide, tmp_path / "judge")
    config = load_config(ROOT / "configs" / "grpo_judge.yaml", [
        "algorithm.options={n: 2, kl_coef: 0, max_new_tokens: 6, judge_template: pointwise, judge_max_new_tokens: 12}",
        "steps=1", "data.batch_size=4", "data.num_examples=32", "model.sft_steps=2", f"roles.judge.model={judge}",
        f"output_dir={tmp_path / 'run'}", *QUIET])
    (row,) = train(config).history
    assert row["judge/unparsed"] == 0 and row["reward/mean"] == pytest.approx(0.7)
    judged = [json.loads(line) for line in (tmp_path / "run" / "judge_samples.jsonl").read_text().splitlines()]
    assert judged and all(sample["verdict"] == "Score: 7" for sample in judged)


def test_a_judge_prompt_beyond_the_judges_context_keeps_the_responses_head(tmp_path: Path) -> None:
    from hybridflow.algorithms.judge_functions import CUT, JudgeText, judge_context

    assert judge_context("tiny-qwen2") == 256 and judge_context("no-such-model") is None
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
    assert judge_context(str(tmp_path)) == 4096
    policy = char_tokenizer()
    models = {"actor": "tiny-qwen2", "judge": "tiny-qwen2"}
    prompts = policy(["rev ab=", "rev abc="], padding=True, padding_side="left", return_tensors="pt")["input_ids"]
    responses = policy(["ba", "cba" * 60], padding=True, return_tensors="pt")["input_ids"]
    mask = (responses != policy.pad_token_id).long()
    fits = JudgeText(role_models=models, policy="actor", judge="judge", template="pointwise", verdict=None,
                     rubric="", scale=10, verdict_tokens=16)  # the tiny judge's own 256 positions
    untouched = JudgeText(role_models=models, policy="actor", judge="judge", template="pointwise", verdict=None,
                          rubric="", scale=10, verdict_tokens=16, context=100_000)
    ids, ids_mask = COMPUTE_FNS.get("judge_prompts")(prompts, responses, mask, ["", ""], state=fits)
    whole, whole_mask = COMPUTE_FNS.get("judge_prompts")(prompts, responses, mask, ["", ""], state=untouched)
    lengths, whole_lengths = ids_mask.sum(dim=1).tolist(), whole_mask.sum(dim=1).tolist()
    assert whole_lengths[1] > 256 - 16 and lengths[1] <= 256 - 16  # the long row is cut to fit, the short one not
    assert lengths[1] > 256 - 16 - len(CUT) - 2  # the longest head that fits, not an arbitrary cut
    assert lengths[0] == whole_lengths[0] and fits.metrics() == {"truncated": 1.0}
    text = char_tokenizer().decode(ids[1][ids_mask[1].bool()].tolist())
    whole_text = char_tokenizer().decode(whole[1][whole_mask[1].bool()].tolist())
    assert "cbacba" in text and text[-60:] == whole_text[-60:]  # the template's closing words survive the cut
    tight = JudgeText(role_models=models, policy="actor", judge="judge", template="pointwise", verdict=None,
                      rubric="", scale=10, verdict_tokens=16, context=40)
    with pytest.raises(ValueError, match=r"without its response is \d+ tokens, beyond the judge's context of 40"):
        COMPUTE_FNS.get("judge_prompts")(prompts, responses, mask, ["", ""], state=tight)
