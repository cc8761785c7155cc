"""Every built-in graph (and the example) runs end to end through its named functions and losses.

A stand-in driver fabricates what each role op would return, calls the compute functions with the
node's inputs and options, then each update's loss: so a misspelt option, field or registry name in a
graph fails here, long before a cluster is involved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.graph import Graph, Op, load_graph
from hybridflow.models.tokenizer import char_tokenizer
from hybridflow.registry import ALGORITHMS, COMPUTE_FNS, LOSSES

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "my_algorithm.py"
PROMPTS, STEPS = 3, 6
ROLE_MODELS = {"actor": "tiny-qwen2", "judge": "tiny-qwen2"}  # no directories: the built-in character tokenizer
SPECS = [*sorted(ALGORITHMS.names()), f"{EXAMPLE}:critic_grpo"]


def _verdicts(rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An LLM judge's answers (a generate whose prompts a node computes): verdicts its parser reads, in the tokens
    of a built-in tiny model's judge (``role_models`` below names no directory, so its character tokenizer)."""
    tokenizer = char_tokenizer()
    texts = [f"score: {k}\nverdict: {'correct' if k > 4 else 'incorrect'}"
             for k in torch.randint(0, 11, (rows,), generator=gen).tolist()]
    ids = tokenizer(texts, padding=True, return_tensors="pt")["input_ids"]
    return ids, (ids != tokenizer.pad_token_id).float()


def role_op_outputs(graph: Graph, rows: int, gen: torch.Generator) -> dict[str, Any]:
    """Plausible tensors for every field a role op writes (right-padded responses)."""
    fields: dict[str, Any] = {"prompts": torch.randint(4, 20, (PROMPTS, 4), generator=gen).repeat_interleave(
        rows // PROMPTS, dim=0), "uid": torch.arange(PROMPTS).repeat_interleave(rows // PROMPTS),
                              "ground_truth": ["abc"] * rows}
    if graph.reads_pairs:  # DPO: the dataset gives each pair's chosen and rejected response, two rows a pair
        lengths = torch.randint(1, STEPS + 1, (rows,), generator=gen)
        fields.update({"prompts": torch.randint(4, 20, (rows, 4), generator=gen),
                       "responses": torch.randint(0, 50, (rows, STEPS), generator=gen),
                       "response_mask": (torch.arange(STEPS)[None, :] < lengths[:, None]).float(),
                       "pair": torch.arange(rows // 2).repeat_interleave(2),
                       "chosen": torch.tensor([1, 0] * (rows // 2))})
        fields["loss_mask"] = fields["response_mask"]
    for node in graph.nodes:
        out = node.port_outputs()
        if node.op is Op.GENERATE and node.port_inputs()["prompts"] in graph.producers:
            fields[out["responses"]], fields[out["response_mask"]] = _verdicts(rows, gen)
        elif node.op is Op.GENERATE:
            lengths = torch.randint(1, STEPS + 1, (rows,), generator=gen)
            fields[out["responses"]] = torch.randint(0, 50, (rows, STEPS), generator=gen)
            fields[out["response_mask"]] = (torch.arange(STEPS)[None, :] < lengths[:, None]).float()
            if "loss_mask" in out:  # what the worker fills in when the engine writes none
                fields[out["loss_mask"]] = fields[out["response_mask"]]
        elif node.op is Op.SCORE:
            fields[out["scores"]] = torch.randn(rows, generator=gen)
        elif node.op in (Op.LOGPROB, Op.REF_LOGPROB):
            fields[next(iter(out.values()))] = -torch.rand(rows, STEPS, generator=gen) * 3
        elif node.op is Op.VALUES:
            fields[out["values"]] = torch.randn(rows, STEPS, generator=gen)
    return fields


def run_computes(graph: Graph, fields: dict[str, torch.Tensor]) -> None:
    for name in graph.order:
        node = graph.node(name)
        if node.op is not Op.COMPUTE:
            continue
        assert node.fn is not None
        fn = COMPUTE_FNS.get(node.fn)
        models = {"role_models": ROLE_MODELS} if getattr(fn, "reads_role_models", False) else {}
        state = fn.make_state(**node.options_dict, **models) if hasattr(fn, "make_state") else None
        kept = {"state": state} if state is not None else {}
        result = fn(*(fields[f] for f in node.inputs), **node.options_dict, **kept)
        results = result if isinstance(result, tuple) else (result,)
        assert len(results) == len(node.outputs), node.name
        for field, value in zip(node.outputs, results, strict=True):
            assert not isinstance(value, torch.Tensor) or torch.isfinite(value).all(), \
                f"{node.name} wrote non-finite {field}"
            fields[field] = value


@pytest.mark.parametrize("spec", SPECS)
def test_every_function_and_loss_a_graph_names_is_registered(spec):
    graph = load_graph(spec)
    for node in graph.nodes:
        if node.fn is not None:
            assert node.fn in COMPUTE_FNS, node.fn
        if node.loss is not None:
            assert node.loss in LOSSES, node.loss


@pytest.mark.parametrize("spec", SPECS)
def test_one_step_through_the_graph_lowers_each_loss(spec):
    graph = load_graph(spec)
    gen = torch.Generator().manual_seed(0)
    rows = PROMPTS * (2 if graph.reads_pairs else graph.samples_per_prompt)
    fields = role_op_outputs(graph, rows, gen)
    run_computes(graph, fields)
    for node in graph.nodes:
        if node.op is not Op.UPDATE:
            continue
        assert node.loss is not None and node.role is not None
        batch = {f: fields[f] for f in node.inputs}
        mask = batch["response_mask"]
        trainable = graph.role(node.role).kind.value
        old = "old_logprobs" if "old_logprobs" in batch or trainable == "value" else "ref_logprobs"  # DPO: no old
        key, start = ("values", batch["values"]) if trainable == "value" else ("logprobs", batch[old])
        param = (start + 0.1 * torch.randn(start.shape, generator=gen)).requires_grad_()
        loss_fn = LOSSES.get(node.loss)
        loss, metrics = loss_fn(outputs={key: param}, batch=batch, **node.options_dict)
        assert loss.dim() == 0 and torch.isfinite(loss)
        assert all(m.dim() == 0 and torch.isfinite(m) and not m.requires_grad for m in metrics.values())
        loss.backward()
        assert param.grad is not None
        assert torch.all(param.grad[mask == 0] == 0), "padding must not get gradient"
        assert param.grad[mask == 1].abs().sum() > 0, "response tokens must get gradient"
        with torch.no_grad():
            stepped = param - 1e-3 * param.grad
        after, _ = loss_fn(outputs={key: stepped}, batch=batch, **node.options_dict)
        assert after < loss, f"{node.name}: a small gradient step must lower {node.loss}"


def test_the_policy_loss_adds_kl_and_entropy_terms_when_asked():
    gen = torch.Generator().manual_seed(3)
    mask = torch.ones(4, 5)
    batch = {"response_mask": mask, "old_logprobs": -torch.rand(4, 5, generator=gen),
             "ref_logprobs": -torch.rand(4, 5, generator=gen), "advantages": torch.randn(4, 5, generator=gen)}
    outputs = {"logprobs": batch["old_logprobs"] + 0.05, "entropy": torch.full((4, 5), 2.0)}
    loss_fn = LOSSES.get("ppo_policy")
    plain, metrics = loss_fn(outputs={"logprobs": outputs["logprobs"]}, batch=batch)
    # ref_kl: the policy's k1 to the reference, logged whenever the batch holds reference log-probs.
    assert set(metrics) == {"pg_loss", "clipfrac", "approx_kl", "clipfrac_lower", "ref_kl"}
    with_kl, metrics = loss_fn(outputs=outputs, batch=batch, kl_coef=0.5, entropy_coef=0.1)
    assert with_kl.item() == pytest.approx(plain.item() + 0.5 * metrics["kl_loss"].item() - 0.1 * 2.0, abs=1e-6)
    assert metrics["kl_loss"] > 0
