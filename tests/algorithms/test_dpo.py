"""DPO: the loss against TRL 1.16's own code, the graph's shape, preference data, and a short CPU training run.

TRL's ``DPOTrainer._compute_loss`` is read from the installed package's source and executed on a stub trainer and a
stub model that returns fixed per-token log-probs (importing ``trl.trainer.dpo_trainer`` would pull accelerate and
datasets: seconds of the suite's budget), as tests/algorithms/test_trl_parity.py does for GRPO.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.metadata
import importlib.util
import math
import warnings
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hybridflow.registry import LOSSES

PAIRS, STEPS = 5, 6
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
QUIET = ["logging.progress=false", "logging.plot=false", "checkpoint.every=0", "logging.trackers=[jsonl]"]


def _trl_compute_loss() -> Any:
    spec = importlib.util.find_spec("trl")
    if spec is None or spec.origin is None or not importlib.metadata.version("trl").startswith("1.16"):
        pytest.skip("needs trl 1.16 installed (pip install trl==1.16.0)")
    return _compiled(str(Path(spec.origin).parent / "trainer" / "dpo_trainer.py"))


@functools.cache
def _compiled(path: str) -> Any:
    tree = ast.parse(Path(path).read_text())
    found = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "_compute_loss"
             and any(isinstance(a, ast.arg) and a.arg == "return_outputs" for a in node.args.args)]
    assert len(found) == 1, "TRL's DPOTrainer._compute_loss moved"
    namespace: dict[str, Any] = {"torch": torch, "F": F, "math": math, "warnings": warnings,
                                 "contextlib": contextlib}
    exec(compile(ast.Module(body=found, type_ignores=[]), path, "exec"), namespace)
    return namespace["_compute_loss"]


class _Accelerator:
    device = torch.device("cpu")

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    gather_for_metrics = gather


def _samples(seed: int) -> dict[str, torch.Tensor]:
    """Per-token policy and reference log-probs of PAIRS chosen then PAIRS rejected responses, ragged lengths."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 3, 1, 4, 5, 2, 6, 4, 3, 5])
    mask = (torch.arange(STEPS)[None, :] < lengths[:, None]).float()
    logps = (-1.5 + 0.6 * torch.randn(2 * PAIRS, STEPS, generator=gen)) * mask
    ref = (logps + 0.5 * torch.randn(2 * PAIRS, STEPS, generator=gen)) * mask
    return {"logps": logps, "ref": ref, "mask": mask}


def _trl_loss(loss_type: str, beta: float, label_smoothing: float, samples: dict[str, torch.Tensor],
              live: torch.Tensor, sft_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """TRL's loss: the batch is [chosen; rejected], each row a 1-token prompt then the completion."""
    rows = 2 * PAIRS
    completion_mask = torch.cat([torch.zeros(rows, 1), samples["mask"]], dim=1).long()  # (2P, 1 + T)
    per_token = live  # (2P, T): log-prob of token t+1 from position t, the completion's tokens
    model = SimpleNamespace(training=True)
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros(rows, STEPS),
                              mean_logits=torch.zeros(rows, STEPS), is_top1=torch.zeros(rows, STEPS, dtype=torch.bool))
    metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list)}
    ref_sums = samples["ref"].sum(dim=1)
    trainer = SimpleNamespace(
        model=model, accelerator=_Accelerator(), aux_loss_enabled=False, precompute_ref_logps=True, ld_alpha=None,
        f_divergence_type="reverse_kl", loss_types=[loss_type, *(["sft"] if sft_coef else [])],
        loss_weights=[1.0, *([sft_coef] if sft_coef else [])], beta=beta,
        label_smoothing=label_smoothing, use_weighting=False, _metrics=metrics, _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.ones(rows, STEPS + 1, dtype=torch.long), "attention_mask": torch.ones(rows, STEPS + 1),
              "completion_mask": completion_mask, "ref_chosen_logps": ref_sums[:PAIRS],
              "ref_rejected_logps": ref_sums[PAIRS:]}
    loss = _trl_compute_loss()(trainer, lambda **_: outputs, inputs, False)
    return loss, metrics["train"]


def _ours(loss_type: str, beta: float, label_smoothing: float, samples: dict[str, torch.Tensor],
          live: torch.Tensor, sft_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Ours: the same rows interleaved (a pair's rows adjacent, rejected first), paired by ``pair`` / ``chosen``."""
    order = torch.stack([torch.arange(PAIRS, 2 * PAIRS), torch.arange(PAIRS)], dim=1).flatten()
    batch = {"loss_mask": samples["mask"][order], "ref_logprobs": samples["ref"][order],
             "pair": (order % PAIRS) + 10, "chosen": (order < PAIRS).long()}
    return LOSSES.get("dpo")(outputs={"logprobs": live[order]}, batch=batch, beta=beta, loss_type=loss_type,
                             label_smoothing=label_smoothing, sft_coef=sft_coef)


@pytest.mark.parametrize(("loss_type", "beta", "label_smoothing", "sft_coef"),
                         [("sigmoid", 0.1, 0.0, 0.0), ("sigmoid", 0.5, 0.0, 0.0), ("ipo", 0.1, 0.0, 0.0),
                          ("ipo", 0.8, 0.0, 0.0), ("hinge", 0.3, 0.0, 0.0), ("robust", 0.2, 0.1, 0.0),
                          ("sigmoid", 0.1, 0.0, 0.7), ("ipo", 0.3, 0.0, 2.0)])
def test_dpo_loss_gradient_and_metrics_match_trl(loss_type: str, beta: float, label_smoothing: float,
                                                 sft_coef: float) -> None:
    samples = _samples(0)
    theirs_live = samples["logps"].clone().requires_grad_(True)
    theirs, logged = _trl_loss(loss_type, beta, label_smoothing, samples, theirs_live, sft_coef)
    (theirs_grad,) = torch.autograd.grad(theirs, theirs_live)
    ours_live = samples["logps"].clone().requires_grad_(True)
    ours, metrics = _ours(loss_type, beta, label_smoothing, samples, ours_live, sft_coef)
    (ours_grad,) = torch.autograd.grad(ours, ours_live)
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_grad * samples["mask"], theirs_grad * samples["mask"], rtol=0, atol=1e-6)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected"):
        assert float(metrics[key]) == pytest.approx(logged[key][0], abs=1e-6), key
    assert 0.0 < logged["rewards/accuracies"][0] < 1.0  # the samples have pairs won and lost
    assert float(theirs.detach()) > 1e-3 and float(theirs_grad.abs().sum()) > 1e-3


def test_sigmoid_label_smoothing_is_conservative_dpo() -> None:
    """TRL 1.16's sigmoid ignores label_smoothing; ours is conservative DPO (TRL's sigmoid before 1.0), checked
    against its formula."""
    samples, eps, beta = _samples(1), 0.2, 0.3
    ours, _ = _ours("sigmoid", beta, eps, samples, samples["logps"])
    sums, ref = samples["logps"].sum(dim=1), samples["ref"].sum(dim=1)
    delta = (sums[:PAIRS] - ref[:PAIRS]) - (sums[PAIRS:] - ref[PAIRS:])
    want = (-(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)).mean()
    torch.testing.assert_close(ours, want, rtol=0, atol=1e-6)
    plain, _ = _ours("sigmoid", beta, 0.0, samples, samples["logps"])
    assert abs(float(ours) - float(plain)) > 1e-3


def test_a_cut_pair_is_refused_naming_it() -> None:
    samples = _samples(2)
    batch = {"loss_mask": samples["mask"][:3], "ref_logprobs": samples["ref"][:3], "pair": torch.tensor([0, 0, 1]),
             "chosen": torch.tensor([1, 0, 1])}
    with pytest.raises(ValueError, match="preference pair 1 has 1 row"):
        LOSSES.get("dpo")(outputs={"logprobs": samples["logps"][:3]}, batch=batch)


@pytest.mark.parametrize(("options", "match"), [({"beta": 0.0}, "beta=0.0"), ({"loss_type": "nca"}, "loss_type"),
                                                ({"loss_type": "ipo", "label_smoothing": 0.1}, "label_smoothing")])
def test_bad_options_are_named(options: dict[str, Any], match: str) -> None:
    samples = _samples(3)
    batch = {"loss_mask": samples["mask"][:2], "ref_logprobs": samples["ref"][:2], "pair": torch.tensor([0, 0]),
             "chosen": torch.tensor([1, 0])}
    with pytest.raises(ValueError, match=match):
        LOSSES.get("dpo")(outputs={"logprobs": samples["logps"][:2]}, batch=batch, **options)


def test_the_dpo_graph_generates_nothing_and_pairs_its_update() -> None:
    from hybridflow.graph import PAIR_INPUTS, Op, RoleKind, load_graph

    graph = load_graph("dpo", beta=0.2, loss_type="ipo")
    assert {role.name: role.kind for role in graph.roles} == {"actor": RoleKind.POLICY,
                                                               "reference": RoleKind.FROZEN_POLICY}
    assert graph.inputs == PAIR_INPUTS and graph.reads_pairs
    assert not any(node.op in (Op.GENERATE, Op.SCORE, Op.LOGPROB) for node in graph.nodes)
    reference = graph.node("reference_ref_logprob")
    assert (reference.op, reference.outputs) == (Op.REF_LOGPROB, ("ref_logprobs",))
    update = graph.node("actor_update")
    assert update.loss == "dpo" and update.options_dict == {"beta": 0.2, "loss_type": "ipo"}
    assert {"ref_logprobs", "pair", "chosen", "loss_mask"} <= set(update.inputs)
    assert graph.order == ("reference_ref_logprob", "actor_update")
    assert not load_graph("grpo").reads_pairs
    assert load_graph("dpo", label_smoothing=0.1).node("actor_update").option("label_smoothing") == 0.1
    assert load_graph("dpo", sft_coef=0.5).node("actor_update").option("sft_coef") == 0.5


@pytest.mark.parametrize(("options", "match"), [({"beta": -1.0}, "beta"), ({"loss_type": "kto"}, "loss_type"),
                                                ({"label_smoothing": 0.5}, "label_smoothing"),
                                                ({"sft_coef": -1.0}, "sft_coef")])
def test_the_graph_refuses_bad_options(options: dict[str, Any], match: str) -> None:
    from hybridflow.graph import load_graph

    with pytest.raises(ValueError, match=match):
        load_graph("dpo", **options)


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    import json

    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("missing", ["chosen", "rejected"])
def test_a_row_without_a_completion_is_named_in_one_line(tmp_path: Path, missing: str) -> None:
    from hybridflow.data.preference import load_preference_records
    from hybridflow.data.sources import MissingColumnError

    rows = [{"prompt": "rev abc=", "chosen": "cba", "rejected": "cab"}, {"prompt": "rev ab=", "chosen": "ba",
                                                                         "rejected": "ab"}]
    del rows[1][missing]
    path = _write_jsonl(tmp_path / "prefs.jsonl", rows)
    with pytest.raises(MissingColumnError) as info:
        load_preference_records(path)
    message = str(info.value)
    assert "\n" not in message and "line 2" in message and f"no {missing!r} column" in message


def test_a_data_path_without_chosen_is_refused_before_the_run(tmp_path: Path) -> None:
    from hybridflow.data.sources import MissingColumnError
    from hybridflow.train.config import load_config
    from hybridflow.train.prepare import prepare_run

    path = _write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": "rev abc=", "rejected": "cab"}])
    config = load_config(CONFIGS / "grpo_reverse.yaml", ["algorithm=dpo", "algorithm.options={beta: 0.1}",
                                                         f"data.path={path}", "data.batch_size=1",
                                                         "optim.actor.mini_batches=1",
                                                         f"output_dir={tmp_path / 'run'}", *QUIET])
    with pytest.raises(MissingColumnError, match=r"line 1: no 'chosen' column"):
        prepare_run(config)
    assert not (tmp_path / "run").exists()


def test_plain_and_conversational_pairs_encode_to_paired_rows() -> None:
    from hybridflow.data.preference import encode_pairs
    from hybridflow.data.prompts import prepare_records
    from hybridflow.models.tokenizer import PLAIN_CHAT_TEMPLATE, WIDE_ALPHABET, char_tokenizer

    tokenizer = char_tokenizer(WIDE_ALPHABET, chat_template=PLAIN_CHAT_TEMPLATE)
    plain = {"prompt": "rev abc=", "ground_truth": "", "chosen": "cba", "rejected": "ca"}
    chat = {"prompt": [{"role": "user", "content": "rev ab="}], "ground_truth": "",
            "chosen": [{"role": "assistant", "content": "ba"}], "rejected": [{"role": "assistant", "content": "ab"}]}
    records = prepare_records([plain, chat], tokenizer).records
    batch = encode_pairs(records, tokenizer)
    assert batch["pair"].tolist() == [0, 0, 1, 1] and batch["chosen"].tolist() == [1, 0, 1, 0]
    eos = tokenizer.eos_token_id
    responses = [row[mask.bool()].tolist() for row, mask in zip(batch["responses"], batch["response_mask"],
                                                                 strict=True)]
    assert responses[0] == [*tokenizer("cba", add_special_tokens=False).input_ids, eos]
    assert responses[1] == [*tokenizer("ca", add_special_tokens=False).input_ids, eos]
    # The chat template renders the assistant turn as its content then EOS: the prompt's text is not repeated.
    assert tokenizer.decode(responses[2]).startswith("ba") and eos in responses[2]
    assert torch.equal(batch["loss_mask"], batch["response_mask"])
    prompts = [tokenizer.decode(row[mask.bool()]) for row, mask in zip(batch["prompts"], batch["prompt_mask"],
                                                                      strict=True)]
    assert prompts[0] == prompts[1] == "rev abc=" and prompts[2] == prompts[3] == "rev ab=\n"


def test_rule_built_pairs_prefer_the_tasks_answer() -> None:
    from hybridflow.data import TASKS
    from hybridflow.data.preference import preference_task_examples

    pairs = preference_task_examples("reverse", 200, seed=3)
    rule = TASKS.get("reverse").reward
    assert all(p["chosen"] == p["ground_truth"] == p["prompt"][4:-1][::-1] for p in pairs)
    assert all(rule(p["rejected"], p["chosen"]) < 1.0 and len(p["rejected"]) == len(p["chosen"]) for p in pairs)
    assert pairs == preference_task_examples("reverse", 200, seed=3)


def _held_out_margin(directory: Path, records: list[dict[str, Any]]) -> float:
    """Mean over held-out pairs of the summed log-prob of the chosen response minus the rejected one's."""
    from hybridflow.backends.common.modeling import policy_outputs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow.data.preference import encode_pairs

    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    batch = encode_pairs(records, tokenizer)
    with torch.no_grad():
        logps = policy_outputs(model, batch, with_entropy=False, packed=False)["logprobs"]
    sums = (logps * batch["response_mask"]).sum(dim=-1)
    return float((sums[0::2] - sums[1::2]).mean())


# Measured with this config over seeds 0-3 (128 held-out pairs each): the held-out margin went 0.80 -> 3.46,
# 1.40 -> 2.97, 1.27 -> 2.86, 0.76 -> 1.55 nats, a rise of +0.79 to +2.66 (mean +1.65). The bar sits below the least.
MIN_MARGIN_RISE = 0.5


@pytest.mark.slow
def test_dpo_on_rule_built_pairs_raises_the_held_out_margin(tmp_path: Path) -> None:
    from hybridflow.data.preference import preference_task_examples
    from hybridflow.train.config import load_config
    from hybridflow.train.loop import train

    config = load_config(CONFIGS / "grpo_reverse.yaml", [
        "algorithm=dpo", "algorithm.options={beta: 0.5, loss_type: sigmoid}", "steps=100", "data.batch_size=16",
        "optim.actor.lr=1e-3", "optim.actor.mini_batches=1", "model.sft_steps=20", "seed=0",
        f"output_dir={tmp_path / 'run'}", *QUIET])
    result = train(config)
    held_out = preference_task_examples("reverse", 128, seed=1000)  # prompts the run's seed-0 pairs do not fix
    before = _held_out_margin(result.run_dir / "init_model", held_out)
    after = _held_out_margin(result.run_dir / "final", held_out)
    print(f"held-out margin {before:.3f} -> {after:.3f}")
    assert after > before + MIN_MARGIN_RISE, f"DPO moved the held-out margin {before:.3f} -> {after:.3f}"
    last = result.history[-10:]
    assert {"actor/rewards/margins", "actor/rewards/accuracies", "actor/rewards/chosen",
            "actor/rewards/rejected"} <= set(last[0])
    assert sum(row["actor/rewards/accuracies"] for row in last) / len(last) > 0.6


def test_validation_and_cut_pairs_are_refused_by_the_config_check(tmp_path: Path) -> None:
    from hybridflow.train.config import load_config
    from hybridflow.train.prepare import prepare_run

    base = ["algorithm=dpo", "algorithm.options={beta: 0.1}", "data.batch_size=6", f"output_dir={tmp_path / 'r'}",
            *QUIET]
    for extra, match in ((["validation.every=5", "data.val_fraction=0.1", "optim.actor.mini_batches=1"],
                          "'validation.every' asks for validation"),
                         (["optim.actor.mini_batches=4"], "does not divide the data.batch_size=6 preference pairs"),
                         (["optim.actor.mini_batches=1", "optim.actor.micro_batch_size=5"], "is odd")):
        config = load_config(CONFIGS / "grpo_reverse.yaml", [*base, *extra])
        with pytest.raises(ValueError, match=match):
            prepare_run(config)
