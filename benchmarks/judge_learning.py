"""GRPO rewarded only by a tiny learned judge lifts the `reverse` task's rule-measured reward; a random judge does not.

    .venv/bin/python benchmarks/judge_learning.py [--seeds 3] [--steps 150] [--judge-sft-steps 1000]
    # or the judges once, then seeds as separate commands (same --out; curves.png merges every seed there):
    .venv/bin/python benchmarks/judge_learning.py --judges-only judge control
    .venv/bin/python benchmarks/judge_learning.py --seeds 1 --first-seed 1

The judge: the tiny Qwen2 (character tokenizer) SFT-trained for ``--judge-sft-steps`` on the one-line, lowercase
template :data:`TEMPLATE` (the prompt, then the reference answer's and the response's characters side by side), to
answer a worked verdict (:func:`worked_verdict`: `` ok``/`` no`` per position, then ``verdict: correct`` or
``verdict: incorrect``, which the ``binary`` parser reads). Its training rows are rule-labelled responses of varied
quality: samples of a weakly SFT-warmed policy and corrupted reference answers (:func:`corrupted`), each labelled
``correct`` when the task's per-character reward reaches ``--threshold`` (:func:`rule_verdict`), the two labels
balanced. Its agreement with the rule (:func:`agreement`; an unparsed verdict disagrees) is measured on held-out
rows of the same kinds (prompts and samples of another seed), and on held-out samples of the weak policy alone.
The control judge is the same SFT on the same rows with the verdicts shuffled among them: sampled, it answers
``correct`` or ``incorrect`` at random, whatever the response.

For each seed, ``grpo_judge`` trains the same start (the tiny model SFT-warmed for ``--sft-steps``, the run's seed)
once with the judge and once with the control, both judges sampled at ``--judge-temperature``, the scores only their
verdicts. The rule measures both: the run's validation pass (``val/reward/mean``: one temperature-1 sample per
held-out prompt, scored by the task's rule, never by the judge) before training and every ``--val-every`` steps.
Prints markdown tables for docs/benchmarks.md; writes ``results_<first>-<last seed>.json`` and ``curves.png`` (every
seed under ``--out``) under ``--out``.
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
JUDGE_TOKENS = 8 * 3 + len(" verdict: incorrect") + 1  # eight marks, the verdict, EOS
JUDGE_SEED = 1_000  # the judge's init, its SFT data and the policy that samples them: seeds no GRPO run uses
HELD_OUT_SEED = 2_000  # the held-out responses' prompts and samples
VAL_REWARD = "val/reward/mean"
LETTERS = "abcdefgh"


def rule_verdict(response: str, answer: str, threshold: float) -> str:
    """The rule's verdict on one response: ``correct`` when the task's per-character reward reaches ``threshold``."""
    return CORRECT if char_accuracy(response, answer) >= threshold else INCORRECT


def worked_verdict(response: str, answer: str, threshold: float) -> str:
    """The judge's taught answer: one mark per position the rule compares (`` ok`` where the response has the
    reference's character, `` no`` where not), then `` verdict: correct|incorrect`` (:func:`rule_verdict`). The marks
    give the SFT a signal at every position, where the verdict alone gives one bit per response; each is as wide as
    a pair of :data:`TEMPLATE`, so the i-th mark sits a fixed distance after the i-th pair."""
    stripped = response.strip()
    marks = "".join(" ok" if index < len(stripped) and index < len(answer) and stripped[index] == answer[index]
                    else " no" for index in range(max(len(stripped), len(answer), 1)))
    return f"{marks} verdict: {rule_verdict(response, answer, threshold)}"


def agreement(verdicts: Sequence[str], labels: Sequence[str], template: JudgeTemplate) -> float:
    """The share of ``verdicts`` (the judge's texts) that parse to the rule's ``labels``; an unparsed one disagrees."""
    if len(verdicts) != len(labels) or not labels:
        raise ValueError(f"agreement: {len(verdicts)} verdicts for {len(labels)} labels (need as many, at least one)")
    wanted = {CORRECT: 1.0, INCORRECT: 0.0}
    return sum(template.parse(verdict) == wanted[label] for verdict, label in zip(verdicts, labels, strict=True)) / len(
        labels)


def corrupted(answer: str, rng: random.Random) -> str:
    """``answer`` with 0 to all of its characters replaced, or cut, lengthened or shifted by one: responses of every
    quality from the exact answer to none of it."""
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
                                    "verdict": worked_verdict(response, record["ground_truth"], threshold)})
        if min(len(found) for found in rows.values()) >= count // 2:
            mixed = rows[CORRECT][:count // 2] + rows[INCORRECT][:count - count // 2]
            rng.shuffle(mixed)
            return mixed
    raise RuntimeError(f"judged_responses: fewer than {count // 2} responses of a label in 100 rounds")


def judge_prompt_records(rows: Sequence[dict[str, str]], template: JudgeTemplate, *,
                         shuffle_labels_seed: int | None = None) -> list[dict[str, str]]:
    """SFT records: the rendered judge prompt, the worked verdict as the answer; the verdicts permuted when
    ``shuffle_labels_seed`` is set (the control judge: the same responses, verdicts that say nothing of them)."""
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
    """One ``grpo_judge`` run scored by ``judge``; the rule's validation reward before training (step 0) and
    after every ``--val-every`` steps, and the judge's mean score per step."""
    options = (f"{{n: {args.n}, kl_coef: 0.0, max_new_tokens: 8, temperature: 1.0, judge_template: {template_file}, "
               f"judge_verdict: binary, judge_max_new_tokens: {JUDGE_TOKENS}, "
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
    template, run_dir = load_template(TEMPLATE, verdict="binary"), Path(result.run_dir)
    return {"rule_reward": curve, "judge_score": [row["reward/mean"] for row in history],
            "agreement_first10": on_policy_agreement(run_dir, template, args.threshold, range(10)),
            "agreement_last10": on_policy_agreement(run_dir, template, args.threshold,
                                                    range(args.steps - 10, args.steps)),
            "unparsed_frac": sum(row.get("judge/unparsed_frac", 0.0) for row in history) / len(history),
            "seconds": time.perf_counter() - started, "run_dir": str(result.run_dir)}


def on_policy_agreement(run_dir: Path, template: JudgeTemplate, threshold: float, steps: range) -> float:
    """The judge's agreement with the rule on the run's own samples of ``steps`` (``judge_samples.jsonl``: each
    step's first ``validation.samples`` rows, their verdicts and the prompts' ground truths)."""
    rows = [json.loads(line) for line in (run_dir / "judge_samples.jsonl").read_text().splitlines()]
    kept = [row for row in rows if row["step"] in steps]
    return agreement([row["verdict"] for row in kept],
                     [rule_verdict(row["response"], row["ground_truth"], threshold) for row in kept], template)


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
        for name, label in (("judge", "learned judge"), ("control", "random judge")):
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
    settings = {key: getattr(args, key) for key in ("sft_steps", "threshold", "judge_sft_steps", "judge_lr",
                                                    "judge_examples", "held_out")}
    record = args.out / name / "judge.json"
    if record.is_file() and json.loads(record.read_text())["settings"] == settings:
        return dict(json.loads(record.read_text()))
    tokenizer, template = char_tokenizer(), load_template(TEMPLATE, verdict="binary")
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
    judge, seconds = train_judge(rows, template, args, shuffle_labels_seed=JUDGES[name])
    found: dict[str, Any] = {"dir": str(save_model_dir(judge, tokenizer, args.out / name)), "sft_seconds": seconds,
                             "settings": settings,
                             "start_samples_correct_share": sum(row["label"] == CORRECT for row in natural) / len(
                                 natural)}
    for held_name, held_rows in (("held_out", held), ("start_samples", natural)):
        labels = [row["label"] for row in held_rows]
        for mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
            verdicts = judge_verdicts(judge, tokenizer, held_rows, template, temperature=temperature, seed=0)
            found[f"{held_name}_{mode}"] = agreement(verdicts, labels, template)
    record.write_text(json.dumps(found, indent=1))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--sft-steps", type=int, default=30, help="the GRPO start's SFT warm start (and the "
                        "judge data's sampling policy's)")
    parser.add_argument("--threshold", type=float, default=0.5, help="the rule reward a correct verdict needs")
    parser.add_argument("--judge-sft-steps", type=int, default=1000)
    parser.add_argument("--judge-lr", type=float, default=3e-3)
    parser.add_argument("--judge-examples", type=int, default=3000)
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
        return
    print("| judge | SFT s | held-out agreement, greedy | sampled | start's samples, greedy | sampled |")
    print("|---|---|---|---|---|---|")
    for name, found in judges.items():
        print(f"| {name} | {found['sft_seconds']:.0f} | {found['held_out_greedy']:.3f} | "
              f"{found['held_out_sampled']:.3f} | {found['start_samples_greedy']:.3f} | "
              f"{found['start_samples_sampled']:.3f} |", flush=True)
    print(f"start's samples rule-labelled correct: {judges['judge']['start_samples_correct_share']:.3f}")
    print(f"| seed | judge: start | end (last {args.window}) | rise | control: start | end | rise | judge's agreement "
          "on its run's samples, first 10 steps | last 10 | judge s | control s |")
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
              f"{judged['agreement_first10']:.3f} | {judged['agreement_last10']:.3f} | {judged['seconds']:.0f} | "
              f"{control['seconds']:.0f} |", flush=True)
        settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
        results.write_text(json.dumps({"settings": settings, "judges": judges, "seeds": rows,
                                       "seconds": time.perf_counter() - started}, indent=1))
    plot_curves(merged_rows(args.out), args.out / "curves.png")
    print(f"results: {results}, curves.png ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
