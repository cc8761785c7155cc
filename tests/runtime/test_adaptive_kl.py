"""PPO's adaptive KL-in-reward: the controller keeps the coefficient across steps, logs it, checkpoints it."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, task_examples
from hybridflow.graph import load_graph
from hybridflow.registry import COMPUTE_FNS
from hybridflow.runtime import Controller, OptimSpec, RoleSpec, default_plan

TOKENIZER = char_tokenizer()


def test_the_coefficient_moves_towards_the_target_by_hand() -> None:
    fn = COMPUTE_FNS.get("kl_penalized_rewards")
    state = fn.make_state(kl_coef=0.1, kl_target=0.5, kl_horizon=10.0)
    mask = torch.ones(2, 3)
    logprobs, ref = torch.zeros(2, 3), torch.full((2, 3), -1.0)  # k1 KL = 1 per token: twice the target
    rewards = fn(torch.tensor([1.0, 0.0]), logprobs, ref, mask, kl_coef=0.1, kl_target=0.5, state=state)
    # The rewards used the coefficient before the update: -0.1 per token, the score on the last token.
    assert torch.allclose(rewards, torch.tensor([[-0.1, -0.1, 0.9], [-0.1, -0.1, -0.1]]))
    assert state.value == 0.1 * (1 + 0.2 * 2 / 10)  # error clipped to +0.2, n_steps 2 of a horizon of 10
    assert fn.make_state(kl_coef=0.1) is None  # no target: a fixed coefficient, no state


def test_the_controller_keeps_logs_and_checkpoints_the_coefficient(random_model_dir: Path, tmp_path: Path) -> None:
    graph = load_graph("ppo", kl_coef=0.2, kl_target=10.0, kl_horizon=8.0, max_new_tokens=4,
                       reward_kind="reward_function")
    specs = {r.name: RoleSpec(name=r.name, kind=r.kind, model=str(random_model_dir),
                              optim=OptimSpec(lr=1e-3) if r.kind.trainable else None)
             for r in graph.roles if r.kind.needs_gpu}
    loader = PromptLoader(records=task_examples("reverse", 32), tokenizer=TOKENIZER, batch_size=4)
    scorer = RuleScorer(TASKS.get("reverse").reward, TOKENIZER)
    with Controller(graph, default_plan(graph), specs=specs, driver_roles={"reward": scorer}) as controller:
        first = controller.step(loader.batch(0), step=0).metrics["kl_rewards/kl_coef"]
        second = controller.step(loader.batch(1), step=1).metrics["kl_rewards/kl_coef"]
        controller.save_checkpoint(str(tmp_path))
    # The KL stays far below the target: each step shrinks the coefficient by 0.2 x 4 samples / horizon 8.
    assert first == 0.2 * 0.9 and abs(second - 0.2 * 0.9 * 0.9) < 1e-12
    with Controller(graph, default_plan(graph), specs=specs, driver_roles={"reward": scorer}) as resumed:
        resumed.load_checkpoint(str(tmp_path))
        assert resumed.node_states["kl_rewards"].state_dict() == {"value": second}
