"""verl-format rows through a real GRPO step: chat template, the runtime's score port, rewards with context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from data_files import verl_row, write_parquet

from hybridflow.data import PromptLoader, load_records, prepare_records, reward_scorer
from hybridflow.graph import load_graph
from hybridflow.models import build_tiny_causal_lm, save_model_dir
from hybridflow.runtime import Controller, OptimSpec, RoleSpec, default_plan


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hybridflow.data import char_tokenizer

    tokenizer = char_tokenizer()
    model = build_tiny_causal_lm("tiny-qwen2", vocab_size=len(tokenizer), seed=0)
    return save_model_dir(model, tokenizer, tmp_path_factory.mktemp("model"))


def test_row_context_reaches_every_reward_style_in_a_grpo_step(tmp_path: Path, model_dir: Path,
                                                               chat_tokenizer: Any) -> None:
    rows = [verl_row(f"{a}+{b}=", str(a + b), i) for i, (a, b) in enumerate([(1, 2), (3, 4), (5, 6), (7, 8)])]
    prepared = prepare_records(load_records(write_parquet(tmp_path / "train.parquet", rows)), chat_tokenizer,
                               max_prompt_length=32)
    seen: dict[str, list[Any]] = {"per_sample": [], "batched": []}

    def per_sample(response: str, ground_truth: str, *, data_source: str | None = None,
                   extra_info: dict[str, Any] | None = None) -> float:
        seen["per_sample"].append((ground_truth, data_source, extra_info))
        return 1.0

    def batched(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        seen["batched"].append((prompts, columns))
        return [0.5] * len(completions)

    graph = load_graph("grpo", reward_kind="reward_function", max_new_tokens=4)
    specs = {r.name: RoleSpec(name=r.name, kind=r.kind, model=str(model_dir),
                              optim=OptimSpec(lr=1e-3) if r.kind.trainable else None)
             for r in graph.roles if r.kind.needs_gpu}
    scorer = reward_scorer([per_sample, batched], chat_tokenizer, weights=[1.0, 2.0])
    loader = PromptLoader(records=prepared.records, tokenizer=chat_tokenizer, batch_size=2, seed=0)
    with Controller(graph, default_plan(graph), specs=specs, driver_roles={"reward": scorer}) as controller:
        result = controller.step(loader.batch(0), step=0)
    assert result.batch["scores"].tolist() == [2.0] * len(result.batch)  # 1.0 * 1 + 2.0 * 0.5
    truths = {truth: (source, info) for truth, source, info in seen["per_sample"]}
    assert all(source == "openai/gsm8k" and info["split"] == "train" for source, info in truths.values())
    expected = {row["reward_model"]["ground_truth"]: row["extra_info"]["index"] for row in rows}
    assert len(truths) == 2 and all(info["index"] == expected[truth] for truth, (_, info) in truths.items())
    prompts, columns = seen["batched"][0]
    assert prompts[0][0]["role"] == "user" and columns["ability"][0] == "math"
