"""Multi-turn rollouts in the async pipeline with partial rollouts: the trajectories run on the driver, every batch
of ready turns is a call on the detached rollout's queue, so weights shipped meanwhile land between turns and
each token records the version that sampled it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from hybridflow.graph import RoleKind, load_graph
from hybridflow.graph.agents import with_environment
from hybridflow.planner import ExecutionMode
from hybridflow.runtime import Controller, OptimSpec, RoleSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from plans import split_plan
from test_agent_steps import LOADER, varied_scores


def boost_eos(controller: Controller) -> None:
    """+4 on the EOS logit of the trainer and of its detached rollout, so the random policy ends its turns."""
    for group in controller.executor.groups:  # type: ignore[attr-defined]
        for engine in group.workers[0].engines.values():
            model = getattr(engine, "model", None)
            if model is None:
                continue
            eos = model.config.eos_token_id

            def boost(module: Any, inputs: Any, output: torch.Tensor, eos: int = eos) -> torch.Tensor:
                output = output.clone()
                output[..., eos] += 4.0
                return output

            model.lm_head.register_forward_hook(boost)


def test_weights_land_between_the_turns_of_a_trajectory(random_model_dir: Path) -> None:
    graph = with_environment(load_graph("grpo_no_ref", n=2, max_new_tokens=40, reward_kind="reward_function",
                                        rollout_correction="tis"),
                             "simulated_tools", env_options={"turns": 3, "latency": "fixed:0.25"}, max_turns=3,
                             max_turn_tokens=6, env_reward_weight=0.0)
    specs = {"actor": RoleSpec(name="actor", kind=RoleKind.POLICY, model=str(random_model_dir),
                               optim=OptimSpec(lr=1e-3))}
    steps = 3
    with Controller(graph, split_plan(), specs=specs, driver_roles={"reward": varied_scores},
                    mode=ExecutionMode(pipeline="async", max_staleness=1, segment_tokens=0),
                    eos_token_id=2) as controller:
        boost_eos(controller)
        results = [controller.step(LOADER.batch(s), step=s, upcoming=lambda s: LOADER.batch(s) if s < steps else None)
                   for s in range(steps)]
    partial = 0.0
    for step, result in enumerate(results):
        batch = result.batch
        mask = batch["response_mask"] != 0
        sampled = batch["loss_mask"] != 0
        assert bool((mask & ~sampled).any()) and int(batch["turns"].max()) >= 2  # multi-turn, observations kept
        lag = step - batch["policy_version"]
        assert int(lag.max()) <= 1 and int(lag.min()) >= 0
        versions = batch["token_policy_version"].masked_fill(~mask, steps)
        assert torch.all(versions[:, 1:] >= versions[:, :-1])  # later turns under newer weights only
        assert bool((batch["rollout_logprobs"][~sampled] == 0).all())
        assert bool((batch["rollout_logprobs"][sampled] < 0).all())
        partial += result.metrics["pipeline/partial_fraction"]
    # Each turn waits 0.25 s on its tool while the trainer's update (milliseconds) ships: some trajectories
    # finish under newer weights than they began with.
    assert partial > 0

