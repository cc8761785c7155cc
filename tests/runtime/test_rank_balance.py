"""Generated rows balanced over data-parallel ranks by length (issue 22, item 2): one permutation per step,
undone when the rows come back, so results are those of the unbalanced step, in row order."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, task_examples
from hybridflow.graph import load_graph
from hybridflow.runtime import Batch, Controller, OptimSpec, RoleSpec, default_plan
from hybridflow.runtime.rank_balance import RankBalance, rank_tokens, row_lengths

TOKENIZER = char_tokenizer()
LOADER = PromptLoader(records=task_examples("reverse", 32), tokenizer=TOKENIZER, batch_size=6)


def _rows(lengths: list[int]) -> Batch:
    mask = torch.tensor([[1] * n + [0] * (max(lengths) - n) for n in lengths])
    return Batch({"response_mask": mask, "prompt_mask": torch.ones(len(lengths), 2, dtype=torch.long)})


def test_the_order_balances_ranks_and_leaves_uneven_rows_alone() -> None:
    lengths = [30, 28, 25, 20, 3, 3, 2, 1]  # long responses first: contiguous shards are far apart
    balance = RankBalance(2)
    order = balance(_rows(lengths))
    assert order is not None and sorted(order) == list(range(8))
    real = row_lengths(_rows(lengths))
    after, before = rank_tokens(real, order, 2), rank_tokens(real, None, 2)
    assert max(after) - min(after) <= 2 < max(before) - min(before)
    assert balance.take_metrics()["dp_balance/rank_tokens_max"] == max(after) and balance.metrics == {}
    assert RankBalance(2)(_rows(lengths[:7])) is None and RankBalance(1)(_rows(lengths)) is None


def _step(model: Path, balance: bool) -> tuple[Batch, dict[str, float], list[int]]:
    graph = load_graph("grpo", reward_kind="reward_function", max_new_tokens=16)
    specs = {r.name: RoleSpec(name=r.name, kind=r.kind, model=str(model),
                              optim=OptimSpec(lr=1e-3) if r.kind.trainable else None)
             for r in graph.roles if r.kind.needs_gpu}
    scorer = RuleScorer(TASKS.get("reverse").reward, TOKENIZER)
    with Controller(graph, default_plan(graph, num_gpus=2), specs=specs, seed=5, driver_roles={"reward": scorer},
                    balance_ranks=balance) as controller:
        prompts = LOADER.batch(0)  # longest prompt first: the first rank's contiguous share holds the long rows
        result = controller.step(prompts.index(torch.argsort(-prompts["prompt_mask"].sum(dim=1))), step=0)
        ranks = controller.executor.groups[0].workers  # type: ignore[attr-defined]
        # What each rank was given and kept this step: its share of the rows.
        shares = [int(rank.store._fields[2, None, "response_mask"].sum() + rank.store._fields[2, None, "prompt_mask"]
                      .sum()) for rank in ranks]
    return result.batch, result.metrics, shares


def test_balanced_ranks_give_the_unbalanced_results_in_row_order(warm_model_dir: Path) -> None:
    plain, plain_metrics, plain_shares = _step(warm_model_dir, balance=False)
    balanced, metrics, shares = _step(warm_model_dir, balance=True)
    assert torch.equal(plain["responses"], balanced["responses"]) and torch.equal(plain["uid"], balanced["uid"])
    for name in ("old_logprobs", "ref_logprobs", "advantages", "scores"):
        assert torch.allclose(plain[name], balanced[name], atol=1e-6), name
    assert shares == [metrics["dp_balance/rank_tokens_max"], metrics["dp_balance/rank_tokens_min"]] or \
        sorted(shares) == [metrics["dp_balance/rank_tokens_min"], metrics["dp_balance/rank_tokens_max"]]
    assert max(plain_shares) == metrics["dp_balance/unbalanced_rank_tokens_max"]
    assert "dp_balance/rank_tokens_max" not in plain_metrics
    # The sorted long rows were spread over the ranks, not left on the first one.
    assert max(shares) - min(shares) < max(plain_shares) - min(plain_shares)
