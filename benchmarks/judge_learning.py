"""GRPO rewarded only by a tiny learned judge lifts the `reverse` task's rule-measured reward; a control judge does not.

    .venv/bin/python benchmarks/judge_learning.py [--seeds 3] [--steps 150] [--judge-sft-steps 1500]
    # or the judges once, then seeds as separate commands (same --out; curves.png merges every seed there):
    .venv/bin/python benchmarks/judge_learning.py --judges-only judge control
    .venv/bin/python benchmarks/judge_learning.py --seeds 1 --first-seed 1

The judge: the tiny Qwen2 (character tokenizer) SFT-trained for ``--judge-sft-steps`` on the one-line, lowercase
template :data:`TEMPLATE` (the prompt, then the reference answer's and the response's characters side by side), to
answer one mark per position the rule compares (:func:`rule_marks`: `` ok`` or `` no``), which the ``marks`` parser
scores as the share of `` ok``: a graded score, the rule's per-character reward when the marks are right (a first
recipe answered marks and a ``binary`` verdict at a threshold, which GRPO learned to reach just). Its training rows
are rule-labelled responses of varied quality: samples of a weakly SFT-warmed policy and corrupted reference
answers (:func:`corrupted`), half of them the shapes the first recipe's policies found to fool the judge (runs of
one letter, doubled, shuffled or padded answers); the labels (the per-character reward reaching ``--threshold``,
:func:`rule_verdict`) balanced. Its agreement with the rule is measured on held-out rows of the same kinds
(prompts and samples of another seed), on held-out samples of the weak policy alone and on held-out corruptions of
the exploit shapes alone: the thresholded score's (:func:`agreement`; an unparsed verdict disagrees), the marks'
(:func:`marks_agreement`: every mark right) and the score's mean distance to the rule's (:func:`score_error`).
The control judge is the same SFT on the same rows with the marks shuffled among them: its marks say nothing of
the response.

For each seed, ``grpo_judge`` trains the same start (the tiny model SFT-warmed for ``--sft-steps``, the run's seed)
once with the judge and once with the control, both judges sampled at ``--judge-temperature``, the scores only their
verdicts' marks. The rule measures both: the run's validation pass (``val/reward/mean``: one temperature-1 sample
per held-out prompt, scored by the task's rule, never by the judge) before training and every ``--val-every``
steps.
Prints markdown tables for docs/benchmarks.md; writes ``results_<first>-<last seed>.json`` and ``curves.png`` (every
seed under ``--out``) under ``--out``. Longer than ~400 lines: the judge's data, its measures and the report are one
script, as the other learning benchmarks are.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from hybridflow.algorithms.judge_templates import JudgeTemplate, load_template

from hybridflow.data import encode_prompts, task_examples
from hybridflow.data.tasks import char_accuracy
from hybridflow.models import build_tiny_causal_lm, save_model_dir
from hybridflow.models.tokenizer import char_tokenizer
from hybridflow.train.config import load_config
from hybridflow.train.loop import train
from hybridflow.train.sft import sft_warm_start

ROOT = Path(__file__).resolve().parents[1]
# The reference's and the response's characters side by side, position by position, each padded with "." to the
# policy's response budget (8 tokens), so the judge compares neighbours; with the two answers one after the other
# (their i-th characters a length-dependent distance apart), 300-1,000 SFT steps left it at chance.
TEMPLATE = ("{{ prompt }} pairs{% for i in range(8) %} {{ ground_truth.ljust(8, '.')[i] }}"
            "{{ response.strip().ljust(8, '.')[i] }}{% endfor %} check:")
CORRECT, INCORRECT = "correct", "incorrect"
VERDICT = "marks"  # the judge's score: the share of its pass marks (algorithms/judge_templates.py, parse_marks)
RECIPE = "marks+exploit-shapes"  # a judge saved by another recipe is not reused
JUDGE_TOKENS = 8 * 3 + 1  # eight marks, EOS
MAX_CHARS = 8  # the policy's response budget: the template shows this many positions
JUDGE_SEED = 1_000  # the judge's init, its SFT data and the policy that samples them: seeds no GRPO run uses
HELD_OUT_SEED = 2_000  # the held-out responses' prompts and samples
VAL_REWARD = "val/reward/mean"
LETTERS = "abcdefgh"


def rule_verdict(response: str, answer: str, threshold: float) -> str:
    """The rule's verdict on one response: ``correct`` when the task's per-character reward reaches ``threshold``."""
    return CORRECT if char_accuracy(response, answer) >= threshold else INCORRECT


def rule_marks(response: str, answer: str) -> str:
    """The judge's taught answer: one mark per position the rule compares, `` ok`` where the response has the
    reference's character, `` no`` where not; their ``ok`` share is the rule's reward. The marks give the SFT a
    signal at every position; each is as wide as a pair of :data:`TEMPLATE`, so the i-th mark sits a fixed distance
    after the i-th pair."""
    stripped = response.strip()
    return "".join(" ok" if index < len(stripped) and index < len(answer) and stripped[index] == answer[index]
                   else " no" for index in range(max(len(stripped), len(answer), 1)))


def _checked(verdicts: Sequence[str], wanted: Sequence[Any], name: str) -> None:
    if len(verdicts) != len(wanted) or not wanted:
        raise ValueError(f"{name}: {len(verdicts)} verdicts for {len(wanted)} rows (need as many, at least one)")


def agreement(verdicts: Sequence[str], labels: Sequence[str], template: JudgeTemplate, threshold: float) -> float:
    """The share of ``verdicts`` (the judge's texts) whose score, thresholded at ``threshold`` as the rule's reward
    is, gives the rule's ``labels``; an unparsed one disagrees."""
    _checked(verdicts, labels, "agreement")
    scores = [template.parse(verdict) for verdict in verdicts]
    return sum(score is not None and (CORRECT if score >= threshold else INCORRECT) == label
               for score, label in zip(scores, labels, strict=True)) / len(labels)


def marks_agreement(verdicts: Sequence[str], marks: Sequence[str]) -> float:
    """The share of ``verdicts`` whose marks are all the rule's ``marks`` (:func:`rule_marks`), as many of them."""
    _checked(verdicts, marks, "marks_agreement")
    return sum(verdict.split() == wanted.split() for verdict, wanted in zip(verdicts, marks, strict=True)) / len(marks)


def score_error(verdicts: Sequence[str], rewards: Sequence[float], template: JudgeTemplate) -> float:
    """The mean distance of the judge's scores to the rule's ``rewards``; an unparsed verdict scores 0, as in the runs
    (``unparsed_score: 0.0``)."""
    _checked(verdicts, rewards, "score_error")
    return sum(abs((template.parse(verdict) or 0.0) - reward)
               for verdict, reward in zip(verdicts, rewards, strict=True)) / len(rewards)


EXPLOIT_SHAPES = ("run", "run", "doubled", "shuffle", "pad")


def corrupted(answer: str, rng: random.Random, kinds: Sequence[str] = ("old", "exploit")) -> str:
    """``answer`` with 0 to all of its characters replaced, or cut, lengthened or shifted by one (``old``: responses
    of every quality from the exact answer to none of it), or, as often, one of :data:`EXPLOIT_SHAPES` (``exploit``:
    :func:`exploit_shape`). At most :data:`MAX_CHARS` characters."""
    if rng.choice(kinds) == "exploit":
        return exploit_shape(answer, rng)
    kind = rng.choice(("replace", "replace", "cut", "extend", "shift"))
    if kind == "cut":
        return answer[:rng.randint(0, len(answer) - 1)]
    if kind == "extend":
        return answer + "".join(rng.choices(LETTERS, k=rng.randint(1, 3)))
    if kind == "shift":
        return rng.choice(LETTERS) + answer[:-1]
    chars = list(answer)
    for index in rng.sample(range(len(chars)), rng.randint(0, len(chars))):
        chars[index] = rng.choice(LETTERS.replace(chars[index], ""))
    return "".join(chars)


def exploit_shape(answer: str, rng: random.Random) -> str:
    """A response of the shapes GRPO found to fool a judge taught on :func:`corrupted`'s ``old`` kinds alone: a run of
    one letter after 0-2 of the answer's first characters (``cbbbbb`` for ``egceb``), the answer with characters
    doubled (``eedd`` for ``ed``), its letters shuffled, or padded with a repeated letter at either end; the letter
    often one of the answer's own."""
    letter = rng.choice(answer if rng.random() < 0.5 else LETTERS)
    kind = rng.choice(EXPLOIT_SHAPES)
    if kind == "run":
        prefix = answer[:rng.randint(0, 2)]
        return prefix + letter * rng.randint(max(1 - len(prefix), 0), MAX_CHARS - len(prefix))
    if kind == "doubled":
        return "".join(char * rng.choice((1, 2, 2)) for char in answer)[:MAX_CHARS]
    if kind == "shuffle":
        return "".join(rng.sample(answer, len(answer)))
    pad = letter * rng.randint(1, MAX_CHARS - len(answer))
    return answer + pad if rng.random() < 0.7 else (pad + answer)[:MAX_CHARS]


def policy_samples(model: Any, tokenizer: Any, records: Sequence[dict[str, str]], seed: int,
                   max_new_tokens: int = 8) -> list[str]:
    """One temperature-1 response of ``model`` per record."""
    torch.manual_seed(seed)
    batch = encode_prompts(records, tokenizer)
    with torch.no_grad():
        out = model.generate(input_ids=batch["prompts"], attention_mask=batch["prompt_mask"], do_sample=True,
                             temperature=1.0, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    return list(tokenizer.batch_decode(out[:, batch["prompts"].shape[1]:], skip_special_tokens=True))


def judged_responses(policy: Any, tokenizer: Any, count: int, seed: int, threshold: float) -> list[dict[str, str]]:
    """``count`` rule-labelled rows (``prompt``, ``ground_truth``, ``response``, ``label``), half of each label:
    samples of ``policy`` and corrupted answers (one each per prompt) until both labels have ``count // 2``."""
    rng = random.Random(seed)
    rows: dict[str, list[dict[str, str]]] = {CORRECT: [], INCORRECT: []}
    for round_ in range(100):
        records = task_examples("reverse", count, seed=seed * 100 + round_)
        sampled = policy_samples(policy, tokenizer, records, seed=seed * 100 + round_)
        for record, sample in zip(records, sampled, strict=True):
            for response in (sample, corrupted(record["ground_truth"], rng)):
                label = rule_verdict(response, record["ground_truth"], threshold)
                rows[label].append({**record, "response": response, "label": label,
                                    "verdict": rule_marks(response, record["ground_truth"])})
        if min(len(found) for found in rows.values()) >= count // 2:
            mixed = rows[CORRECT][:count // 2] + rows[INCORRECT][:count - count // 2]
            rng.shuffle(mixed)
            return mixed
    raise RuntimeError(f"judged_responses: fewer than {count // 2} responses of a label in 100 rounds")


def judge_prompt_records(rows: Sequence[dict[str, str]], template: JudgeTemplate, *,
                         shuffle_labels_seed: int | None = None) -> list[dict[str, str]]:
    """SFT records: the rendered judge prompt, the rule's marks as the answer; the marks permuted among the rows
    when ``shuffle_labels_seed`` is set (the control judge: the same responses, marks that say nothing of them)."""
    labels = [row["verdict"] for row in rows]
    if shuffle_labels_seed is not None:
        random.Random(shuffle_labels_seed).shuffle(labels)
    return [{"prompt": template.render(prompt=row["prompt"], response=row["response"],
                                       ground_truth=row["ground_truth"]), "ground_truth": label}
            for row, label in zip(rows, labels, strict=True)]


def judge_verdicts(judge: Any, tokenizer: Any, rows: Sequence[dict[str, str]], template: JudgeTemplate, *,
                   temperature: float = 0.0, seed: int = 0, batch_size: int = 256) -> list[str]:
    """The judge's verdict texts on ``rows``, rendered and encoded as the run's ``judge_prompts`` node does (no
    special tokens; the character tokenizer has no chat template), greedy at temperature 0."""
    torch.manual_seed(seed)
    verdicts: list[str] = []
    for start in range(0, len(rows), batch_size):
        chunk = [{"prompt": template.render(prompt=row["prompt"], response=row["response"],
                                            ground_truth=row["ground_truth"]), "ground_truth": ""}
                 for row in rows[start:start + batch_size]]
        batch = encode_prompts(chunk, tokenizer)
        sampling = {"do_sample": True, "temperature": temperature} if temperature else {"do_sample": False}
        with torch.no_grad():
            out = judge.generate(input_ids=batch["prompts"], attention_mask=batch["prompt_mask"],
                                 max_new_tokens=JUDGE_TOKENS, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id, **sampling)
        verdicts += tokenizer.batch_decode(out[:, batch["prompts"].shape[1]:], skip_special_tokens=True)
    return verdicts


def train_judge(rows: Sequence[dict[str, str]], template: JudgeTemplate, args: argparse.Namespace, *,
                shuffle_labels_seed: int | None = None) -> tuple[Any, float]:
    """A tiny judge SFT-trained on ``rows``' verdicts; returns it and the SFT's seconds."""
    tokenizer = char_tokenizer()
    judge = build_tiny_causal_lm("tiny-qwen2", vocab_size=len(tokenizer), seed=JUDGE_SEED)
    started = time.perf_counter()
    sft_warm_start(judge, tokenizer, judge_prompt_records(rows, template, shuffle_labels_seed=shuffle_labels_seed),
                   steps=args.judge_sft_steps, batch_size=32, lr=args.judge_lr, seed=JUDGE_SEED)
    return judge.eval(), time.perf_counter() - started


def grpo_judge_run(seed: int, judge: Path, template_file: Path, out: Path, args: argparse.Namespace,
                   extra: Sequence[str] = ()) -> dict[str, Any]:
    """One ``grpo_judge`` run scored by ``judge``'s marks; the rule's validation reward before training (step 0) and
    after every ``--val-every`` steps, the judge's mean score per step, and its agreement with the rule on the run's
    samples of the first and the last 10 steps."""
    options = (f"{{n: {args.n}, kl_coef: 0.0, max_new_tokens: 8, temperature: 1.0, judge_template: {template_file}, "
               f"judge_verdict: {VERDICT}, judge_max_new_tokens: {JUDGE_TOKENS}, "
               f"judge_temperature: {args.judge_temperature}, unparsed_score: 0.0}}")
    config = load_config(ROOT / "configs" / "grpo_reverse.yaml", [
        "algorithm=grpo_judge", f"algorithm.options={options}", f"roles.judge.model={judge}", f"steps={args.steps}",
        f"data.batch_size={args.batch_size}", f"optim.actor.lr={args.lr}", "optim.actor.mini_batches=2",
        f"model.sft_steps={args.sft_steps}", f"data.val_fraction={args.val_fraction}",
        f"validation.every={args.val_every}", "validation.before_train=true", f"seed={seed}", f"output_dir={out}",
        "checkpoint.every=0", "logging.progress=false", "logging.plot=false", "logging.trackers=[jsonl]", *extra])
    started = time.perf_counter()
    result = train(config, overwrite=True)
    history = result.history
    curve = [(0, history[0][VAL_REWARD])] + [(row["step"] + 1, row[VAL_REWARD]) for row in history[1:]
                                             if VAL_REWARD in row]
    template, run_dir = load_template(TEMPLATE, verdict=VERDICT), Path(result.run_dir)
    first, last = (on_policy_agreement(run_dir, template, args.threshold, steps)
                   for steps in (range(10), range(args.steps - 10, args.steps)))
    return {"rule_reward": curve, "judge_score": [row["reward/mean"] for row in history],
            **{f"{name}_first10": value for name, value in first.items()},
            **{f"{name}_last10": value for name, value in last.items()},
            "unparsed_frac": sum(row.get("judge/unparsed_frac", 0.0) for row in history) / len(history),
            "seconds": time.perf_counter() - started, "run_dir": str(result.run_dir)}


def on_policy_agreement(run_dir: Path, template: JudgeTemplate, threshold: float, steps: range) -> dict[str, float]:
    """The judge's agreement with the rule on the run's own samples of ``steps`` (``judge_samples.jsonl``: each
    step's first ``validation.samples`` rows, their verdicts and the prompts' ground truths): ``agreement``,
    ``marks_agreement`` and ``score_error`` (the functions of those names)."""
    rows = [json.loads(line) for line in (run_dir / "judge_samples.jsonl").read_text().splitlines()]
    kept = [row for row in rows if row["step"] in steps]
    return judged_agreement([row["verdict"] for row in kept], kept, template, threshold)


def judged_agreement(verdicts: Sequence[str], rows: Sequence[dict[str, Any]], template: JudgeTemplate,
                     threshold: float) -> dict[str, float]:
    """``verdicts`` on ``rows`` (``response``, ``ground_truth``) against the rule: ``agreement`` (the thresholded
    score), ``marks_agreement`` and ``score_error``."""
    labels = [rule_verdict(row["response"], row["ground_truth"], threshold) for row in rows]
    return {"agreement": agreement(verdicts, labels, template, threshold),
            "marks_agreement": marks_agreement(verdicts, [rule_marks(row["response"], row["ground_truth"])
                                                          for row in rows]),
            "score_error": score_error(verdicts, [char_accuracy(row["response"], row["ground_truth"])
                                                  for row in rows], template)}


def rise(curve: Sequence[tuple[int, float]], window: int) -> tuple[float, float]:
    """The rule reward before training and the mean of the last ``window`` validation passes."""
    return curve[0][1], sum(value for _, value in curve[-window:]) / window


def plot_curves(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """One panel per seed: the rule-measured validation reward of the judged run and of the control."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(rows), figsize=(4 * len(rows), 3.2), sharey=True, squeeze=False)
    for axis, row in zip(axes[0], rows, strict=True):
        for name, label in (("judge", "learned judge"), ("control", "control judge (shuffled marks)")):
            steps, values = zip(*row[name]["rule_reward"], strict=True)
            axis.plot(steps, values, label=label, marker=".")
        axis.set(title=f"seed {row['seed']}", xlabel="steps")
    axes[0][0].set_ylabel("validation reward (the task's rule)")
    axes[0][0].legend(loc="upper left", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


JUDGES = {"judge": None, "control": JUDGE_SEED}  # each judge's label shuffle: none, or the control's seed


def merged_rows(out: Path) -> list[dict[str, Any]]:
    """Every seed's row from the ``results_*.json`` under ``out`` (seeds run as separate commands), by seed."""
    rows = [row for path in sorted(out.glob("results_*.json")) for row in json.loads(path.read_text())["seeds"]]
    return sorted({row["seed"]: row for row in rows}.values(), key=lambda row: row["seed"])


def build_judge(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The judge ``name`` (:data:`JUDGES`) saved under ``--out/<name>``, with its held-out agreement; a judge
    already saved there with the same settings is reused (``judge.json``), so seeds can run in parallel after it."""
    settings = {"recipe": RECIPE, **{key: getattr(args, key) for key in (
        "sft_steps", "threshold", "judge_sft_steps", "judge_lr", "judge_examples", "held_out")}}
    record = args.out / name / "judge.json"
    if record.is_file() and json.loads(record.read_text())["settings"] == settings:
        return dict(json.loads(record.read_text()))
    tokenizer, template = char_tokenizer(), load_template(TEMPLATE, verdict=VERDICT)
    policy = build_tiny_causal_lm("tiny-qwen2", vocab_size=len(tokenizer), seed=JUDGE_SEED)
    sft_warm_start(policy, tokenizer, task_examples("reverse", 2000, seed=JUDGE_SEED), steps=args.sft_steps,
                   lr=3e-3, seed=JUDGE_SEED)
    rows = judged_responses(policy, tokenizer, args.judge_examples, JUDGE_SEED, args.threshold)
    held = judged_responses(policy, tokenizer, args.held_out, HELD_OUT_SEED, args.threshold)
    # The start's own samples, as GRPO's first steps see them: mostly below the threshold.
    records = task_examples("reverse", args.held_out, seed=HELD_OUT_SEED + 1)
    natural = [{**record, "response": response, "label": rule_verdict(response, record["ground_truth"],
                                                                      args.threshold)}
               for record, response in zip(records, policy_samples(policy, tokenizer, records, HELD_OUT_SEED + 1),
                                           strict=True)]
    rng, records = random.Random(HELD_OUT_SEED + 2), task_examples("reverse", args.held_out, seed=HELD_OUT_SEED + 2)
    shapes = [{**record, "response": exploit_shape(record["ground_truth"], rng)} for record in records]
    judge, seconds = train_judge(rows, template, args, shuffle_labels_seed=JUDGES[name])
    found: dict[str, Any] = {"dir": str(save_model_dir(judge, tokenizer, args.out / name)), "sft_seconds": seconds,
                             "settings": settings,
                             "start_samples_correct_share": sum(row["label"] == CORRECT for row in natural) / len(
                                 natural)}
    for held_name, held_rows in (("held_out", held), ("start_samples", natural), ("exploit_shapes", shapes)):
        for mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
            verdicts = judge_verdicts(judge, tokenizer, held_rows, template, temperature=temperature, seed=0)
            for measure, value in judged_agreement(verdicts, held_rows, template, args.threshold).items():
                found[f"{held_name}_{mode}_{measure}"] = value
    record.write_text(json.dumps(found, indent=1))
    return found


MEASURES = ("agreement", "marks_agreement", "score_error")


def on_policy(run: dict[str, Any], steps: str) -> str:
    """A run's agreement with the rule on its samples of ``steps`` (``first10`` or ``last10``), as a table cell."""
    return " / ".join(f"{run[f'{measure}_{steps}']:.3f}" for measure in MEASURES)


def print_judges(judges: dict[str, dict[str, Any]]) -> None:
    """The judges' held-out agreement, a markdown table (thresholded score / every mark / mean score error)."""
    sets = ("held_out", "start_samples", "exploit_shapes")
    print("| judge | SFT s | " + " | ".join(f"{held} {mode} (thresholded / marks / score error)" for held in sets
                                            for mode in ("greedy", "sampled")) + " |")
    print("|---|---|" + "---|" * 2 * len(sets))
    for name, found in judges.items():
        cells = [" / ".join(f"{found[f'{held}_{mode}_{measure}']:.3f}" for measure in MEASURES)
                 for held in sets for mode in ("greedy", "sampled")]
        print(f"| {name} | {found['sft_seconds']:.0f} | " + " | ".join(cells) + " |", flush=True)
    share = next(iter(judges.values()))["start_samples_correct_share"]
    print(f"start's samples rule-labelled correct: {share:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--sft-steps", type=int, default=30, help="the GRPO start's SFT warm start (and the "
                        "judge data's sampling policy's)")
    parser.add_argument("--threshold", type=float, default=0.5, help="the rule reward a correct verdict needs")
    parser.add_argument("--judge-sft-steps", type=int, default=1500)
    parser.add_argument("--judge-lr", type=float, default=3e-3)
    parser.add_argument("--judge-examples", type=int, default=4000)
    parser.add_argument("--held-out", type=int, default=256)
    parser.add_argument("--judge-temperature", type=float, default=1.0, help="both judges' sampling in the runs")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--val-fraction", type=float, default=0.05, help="of the task's 2000 prompts, held out")
    parser.add_argument("--val-every", type=int, default=10)
    parser.add_argument("--window", type=int, default=3, help="validation passes in the end's mean")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_judge")
    parser.add_argument("--judges-only", nargs="+", choices=list(JUDGES), help="build (or reuse) these judges "
                        "and stop: a later run with the same --out and settings reuses them")
    args = parser.parse_args()
    if args.val_every < 2:
        parser.error("--val-every must be >= 2 (step 0's row holds the pass before training)")
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    template_file = args.out / "template.jinja"
    template_file.write_text(TEMPLATE, encoding="utf-8")  # no trailing new line: the tokenizer has none
    judges = {name: build_judge(name, args) for name in (args.judges_only or JUDGES)}
    if args.judges_only:
        print(json.dumps(judges, indent=1))
        print_judges(judges)
        return
    print_judges(judges)
    print(f"| seed | judge: start | end (last {args.window}) | rise | control: start | end | rise | judge's agreement "
          "(thresholded / marks / score error) on its run's samples, first 10 steps | last 10 | judge s | control s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows: list[dict[str, Any]] = []
    results = args.out / f"results_{args.first_seed}-{args.first_seed + args.seeds - 1}.json"
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        judged = grpo_judge_run(seed, Path(judges["judge"]["dir"]), template_file, args.out / str(seed) / "judge",
                                args)
        start_dir = Path(judged["run_dir"]) / "init_model"  # the control starts from the very same weights
        control = grpo_judge_run(seed, Path(judges["control"]["dir"]), template_file,
                                 args.out / str(seed) / "control", args, [f"model.path={start_dir}"])
        rows.append({"seed": seed, "judge": judged, "control": control})
        (j0, j1), (c0, c1) = rise(judged["rule_reward"], args.window), rise(control["rule_reward"], args.window)
        print(f"| {seed} | {j0:.3f} | {j1:.3f} | {j1 - j0:+.3f} | {c0:.3f} | {c1:.3f} | {c1 - c0:+.3f} | "
              f"{on_policy(judged, 'first10')} | {on_policy(judged, 'last10')} | {judged['seconds']:.0f} | "
              f"{control['seconds']:.0f} |", flush=True)
        settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
        results.write_text(json.dumps({"settings": settings, "judges": judges, "seeds": rows,
                                       "seconds": time.perf_counter() - started}, indent=1))
    plot_curves(merged_rows(args.out), args.out / "curves.png")
    print(f"results: {results}, curves.png ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
