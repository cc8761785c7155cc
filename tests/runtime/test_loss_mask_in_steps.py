"""The loss mask through the runtime: the worker's default and checks, the joins of streamed chunks and of
partial-rollout segments, and steps on a tiny model whose rollout keeps tokens in a response without training on
them (a multi-turn rollout's tool outputs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from masking_backend import expected_masks
from plans import split_plan

from hybridflow.data import PromptLoader, char_tokenizer, task_examples
from hybridflow.graph import Graph, GraphBuilder, RoleKind, load_graph
from hybridflow.planner.execution import ExecutionMode
from hybridflow.runtime import Batch, Controller, OptimSpec, RoleSpec, default_plan
from hybridflow.runtime.loss_mask import with_loss_mask
from hybridflow.runtime.protocols import SamplingParams
from hybridflow.runtime.worker import run_role_op
from hybridflow.train.metrics import step_metrics

TOKENIZER = char_tokenizer()
LOADER = PromptLoader(records=task_examples("reverse", 64), tokenizer=TOKENIZER, batch_size=4)
MASKING = f"{Path(__file__).with_name('masking_backend.py')}:BACKEND"


def generate_node(**options: object) -> Graph:
    g = GraphBuilder("g")
    actor, reward = g.role("actor", RoleKind.POLICY), g.role("reward", RoleKind.REWARD_FUNCTION)
    g.generate(actor, **options)  # type: ignore[arg-type]
    g.score(reward)
    g.update(actor, loss="ppo_policy", inputs=("prompts", "responses", "response_mask", "scores"))
    return g.build()


def engine_outputs(**extra: torch.Tensor) -> Batch:
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    return Batch({"responses": torch.randint(4, 9, (2, 4)), "response_mask": mask, **extra})


def test_the_worker_fills_the_loss_mask_from_the_response_mask_when_the_engine_writes_none() -> None:
    node = generate_node(loss_mask=True).node("actor_generate")
    out = with_loss_mask(node, engine_outputs())
    assert torch.equal(out["loss_mask"], out["response_mask"])
    plain = generate_node().node("actor_generate")
    assert "loss_mask" not in with_loss_mask(plain, engine_outputs())  # a graph without it runs as before


def test_the_worker_keeps_an_engines_loss_mask_and_zeroes_behaviour_logprobs_outside_it() -> None:
    node = generate_node(loss_mask=True, logprobs=True).node("actor_generate")
    assert node.outputs == ("responses", "response_mask", "rollout_logprobs", "loss_mask")
    loss_mask = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 0]])
    out = with_loss_mask(node, engine_outputs(loss_mask=loss_mask, rollout_logprobs=-torch.rand(2, 4) - 0.1))
    assert torch.equal(out["loss_mask"], loss_mask)
    assert bool((out["rollout_logprobs"][loss_mask == 0] == 0).all())
    assert bool((out["rollout_logprobs"][loss_mask != 0] < 0).all())


@pytest.mark.parametrize(("loss_mask", "message"), [
    (torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]), "must be a subset of response_mask"),
    (torch.ones(2, 3, dtype=torch.long), r"shape \(2, 3\); it must match response_mask \(2, 4\)"),
])
def test_a_bad_engine_loss_mask_names_the_node_and_the_rule(loss_mask: torch.Tensor, message: str) -> None:
    node = generate_node(loss_mask=True).node("actor_generate")
    with pytest.raises(ValueError, match=f"generate node 'actor_generate'.*{message}"):
        with_loss_mask(node, engine_outputs(loss_mask=loss_mask))


class FixedRollout:
    """An engine whose generate returns the given outputs."""

    def __init__(self, outputs: Batch) -> None:
        self.outputs = outputs

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        return self.outputs


def test_a_node_that_would_drop_an_engines_loss_mask_is_refused_with_the_fix() -> None:
    node = generate_node().node("actor_generate")
    prompts = Batch({"prompts": torch.ones(2, 3, dtype=torch.long), "prompt_mask": torch.ones(2, 3)})
    same = engine_outputs(loss_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]))
    out = run_role_op(FixedRollout(same), node, prompts, seed=0)
    assert out.keys() == ["responses", "response_mask"]  # nothing is lost: it equals the response mask
    with pytest.raises(ValueError, match="add loss_mask=True to it"):
        run_role_op(FixedRollout(engine_outputs(loss_mask=torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]]))), node,
                    prompts, seed=0)


def test_padding_rows_of_a_mini_batch_have_no_trained_tokens() -> None:
    batch = engine_outputs(loss_mask=torch.tensor([[1, 0, 1, 0], [0, 1, 0, 0]]))
    padded, pad = batch.slice(0, 1).union(Batch()).pad_to_multiple(2)
    assert pad == 1 and int(padded["loss_mask"][1].sum()) == 0 and int(padded["response_mask"][1].sum()) == 0
    assert torch.equal(padded["loss_mask"][0], batch["loss_mask"][0])


# ---- steps on a tiny model ---------------------------------------------------------------------------------------
def varied_scores(batch: Batch) -> Batch:
    """A driver reward that differs within every group, so group-relative advantages are not all zero."""
    return Batch({"scores": (torch.arange(len(batch)) % 3).float()})


def hole_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """``response_mask`` with its 2nd and 3rd tokens left out of the loss (a tool's output after the first token)."""
    loss_mask = response_mask.clone()
    loss_mask[:, 1:3] = 0
    return loss_mask


def mask_generate(controller: Controller) -> None:
    """Wrap the actor engine's generate so it returns :func:`hole_mask` as its loss mask."""
    engine = controller.executor.groups[0].workers[0].engines["actor"]  # type: ignore[attr-defined]
    original = engine.generate

    def generate(batch: Batch, sampling: object) -> Batch:
        out = original(batch, sampling)
        return Batch({**out.tensors, "loss_mask": hole_mask(out["response_mask"])})

    engine.generate = generate


def weights(controller: Controller, role: str) -> torch.Tensor:
    engine = controller.executor.groups[0].workers[0].engines[role]  # type: ignore[attr-defined]
    return torch.cat([p.detach().flatten().clone() for p in engine.model.parameters()])


def specs(graph: Graph, model: Path) -> dict[str, RoleSpec]:
    # default_plan's micro batch (64 rows) holds a step's rows: one micro batch
    return {r.name: RoleSpec(name=r.name, kind=r.kind, model=str(model),
                             optim=OptimSpec(lr=1e-3) if r.kind.trainable else None)
            for r in graph.roles if r.kind.needs_gpu}


def masked_step(graph: Graph, model: Path, trained: str) -> tuple[Any, bool]:
    """One step of ``graph`` whose rollout masks tokens; the result and whether role ``trained`` moved."""
    with Controller(graph, default_plan(graph), specs=specs(graph, model),
                    driver_roles={"reward": varied_scores}) as controller:
        mask_generate(controller)
        before = weights(controller, trained)
        result = controller.step(LOADER.batch(0), step=0)
        return result, not torch.equal(before, weights(controller, trained))


def test_a_grpo_step_trains_on_the_loss_mask_only(random_model_dir: Path) -> None:
    graph = load_graph("grpo_no_ref", reward_kind="reward_function", max_new_tokens=6, rollout_correction="tis")
    result, moved = masked_step(graph, random_model_dir, "actor")
    batch = result.batch
    response_mask, loss_mask = batch["response_mask"], batch["loss_mask"]
    assert torch.equal(loss_mask, hole_mask(response_mask)) and bool((response_mask[:, 3:].sum(dim=1) > 0).any())
    assert moved, "the update did not train the actor"
    off = (response_mask != 0) & (loss_mask == 0)
    assert bool((batch["advantages"][off] == 0).all()) and bool((batch["rollout_logprobs"][off] == 0).all())
    metrics = step_metrics(result, 1.0)
    assert metrics["tokens/trained"] == float(loss_mask.sum()) < metrics["tokens/response"] == float(
        response_mask.sum())
    assert metrics["response_length/mean"] == float(response_mask.sum(dim=1).float().mean())
    # On-policy, the first step's surrogate is minus the mean advantage over the *trained* tokens.
    advantages = batch["advantages"]
    trained_mean = float((advantages * loss_mask).sum() / loss_mask.sum())
    response_mean = float((advantages * response_mask).sum() / response_mask.sum())
    assert abs(trained_mean - response_mean) > 1e-3  # the check below can tell the masks apart
    assert result.metrics["actor/pg_loss"] == pytest.approx(-trained_mean, abs=1e-4)
    assert result.metrics["actor/rollout_logprob_gap_max"] < 1e-3  # the zeroed logprobs stay out of it


def test_a_ppo_step_gives_masked_tokens_no_return_and_trains_the_critic(random_model_dir: Path) -> None:
    graph = load_graph("ppo", reward_kind="reward_function", max_new_tokens=6)
    result, moved = masked_step(graph, random_model_dir, "critic")
    batch = result.batch
    off = (batch["response_mask"] != 0) & (batch["loss_mask"] == 0)
    assert bool(off.any()) and moved
    for name in ("returns", "advantages", "token_rewards"):
        assert bool((batch[name][off] == 0).all()), name
    assert bool((batch["returns"][batch["loss_mask"] != 0] != 0).any())


def test_a_graph_without_a_loss_mask_refuses_a_rollout_that_masks_tokens(random_model_dir: Path) -> None:
    graph = generate_node(max_new_tokens=4)
    with Controller(graph, default_plan(graph), specs=specs(graph, random_model_dir),
                    driver_roles={"reward": varied_scores}) as controller:
        mask_generate(controller)
        with pytest.raises(Exception, match="add loss_mask=True"):
            controller.step(LOADER.batch(0), step=0)


# ---- joins: streamed chunks and partial-rollout segments ------------------------------------------------------------
def bigram_controller(graph: Graph, eos_token_id: int | None = None, **mode: object) -> Controller:
    spec = RoleSpec(name="actor", kind=RoleKind.POLICY, model="unused", backend=MASKING, optim=OptimSpec(lr=10.0),
                    options={"vocab_size": len(TOKENIZER)})
    return Controller(graph, split_plan(), specs={"actor": spec}, driver_roles={"reward": varied_scores},
                      mode=ExecutionMode(**mode), eos_token_id=eos_token_id)  # type: ignore[arg-type]


def assert_joined_masks(results: list) -> None:  # type: ignore[type-arg]
    padded = 0
    for result in results:
        batch = result.batch
        response_mask, loss_mask = expected_masks(batch["responses"], batch["response_mask"])
        assert torch.equal(batch["response_mask"].long(), response_mask)
        assert torch.equal(batch["loss_mask"].long(), loss_mask)
        assert bool(((batch["response_mask"] != 0) & (batch["loss_mask"] == 0)).any())
        padded += int((batch["response_mask"].sum(dim=1) < batch["responses"].shape[1]).sum())
        metrics = step_metrics(result, 1.0)
        assert metrics["tokens/trained"] == float(loss_mask.sum())
    assert padded, "every response had the full width: the joins' padding went untested"


@pytest.mark.parametrize("options", [{}, {"stream_chunks": 3}], ids=["whole", "streamed"])
def test_streamed_chunks_join_the_loss_mask_with_the_responses(options: dict) -> None:
    graph = load_graph("grpo_no_ref", n=2, max_new_tokens=6, reward_kind="reward_function")
    with bigram_controller(graph, **options) as controller:
        results = [controller.step(LOADER.batch(s), step=s) for s in range(3)]
    assert_joined_masks(results)


def test_partial_rollout_segments_join_the_loss_mask_with_the_responses() -> None:
    from masking_backend import STOP

    graph = load_graph("grpo_no_ref", n=4, max_new_tokens=7, reward_kind="reward_function")
    steps = 4

    def upcoming(step: int) -> Batch | None:
        return LOADER.batch(step) if step < steps else None

    with bigram_controller(graph, pipeline="async", max_staleness=1, segment_tokens=2,
                           eos_token_id=STOP) as controller:
        results = [controller.step(LOADER.batch(s), step=s, upcoming=upcoming) for s in range(steps)]
    assert_joined_masks(results)
    assert any(int(r.batch["response_mask"].sum(dim=1).max()) > 2 for r in results)  # joined over segments
