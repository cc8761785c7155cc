"""The ``server`` rollout's options, replica command and weight-reload errors, without starting vLLM."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from hybridflow.backends.vllm.server import ServerOptions, reload_replica, server_command, server_env

from hybridflow.planner import Sharding
from hybridflow.runtime.servers import FleetConfig, ServerFleet

FAKE = str(Path(__file__).parents[1] / "runtime" / "fake_openai_server.py")


def test_options_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match=r"replicas"):
        ServerOptions.parse({"replica": 2}, "actor")  # a misspelt key
    with pytest.raises(ValueError, match=r"role 'actor': server option replicas=0 must be an integer >= 1"):
        ServerOptions.parse({"replicas": 0}, "actor")
    with pytest.raises(ValueError, match=r"server option rollout_dtype='fp8'"):
        ServerOptions.parse({"rollout_dtype": "fp8"}, "actor")
    assert ServerOptions.parse({"replicas": 2, "port_base": 18000}, "actor").fleet().replicas == 2


def test_the_replica_command_states_what_token_exactness_needs() -> None:
    options = ServerOptions(server_args={"max_num_batched_tokens": 512, "enable_prefix_caching": True})
    command = server_command(model_dir="/m", name="actor", dtype="fp32", seed=3, options=options, max_num_seqs=16)
    argv = command(1, 18001)
    line = " ".join(argv)
    assert "--host 127.0.0.1 --port 18001" in line and "--served-model-name actor" in line
    assert "--logprobs-mode raw_logprobs" in line and "--dtype float32" in line and "--seed 3" in line
    assert "--max-num-seqs 16" in line and "--max-num-batched-tokens 512" in line
    assert argv[-1] == "--enable-prefix-caching"  # a True value is a bare flag
    env = server_env(ServerOptions(threads=2))
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["OMP_NUM_THREADS"] == "2"


def test_a_replica_that_refuses_a_weight_reload_is_named_with_its_log(tmp_path: Path) -> None:
    config = FleetConfig(router=False, log_dir=str(tmp_path))
    refusal = rf"weight sync: replica-0 .*/pause\) -> 404.*{tmp_path}/replica-0.log"
    with ServerFleet(config, lambda i, port: [sys.executable, FAKE, str(port)]) as fleet, \
            pytest.raises(RuntimeError, match=refusal):
        reload_replica(fleet.replicas[0], tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("vllm_router") is None, reason="needs vllm-router (hybridflow[servers])")
def test_a_lost_replica_is_restarted_on_the_last_weights_and_counted(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The server rollout on fake replicas (no vLLM): a replica lost between steps comes back on the weights sent
    last before it takes requests; the step's generate metrics count it; every replica lost is one error."""
    from harness import context, layout, role_spec
    from hybridflow.backends.vllm import server
    from safetensors.torch import save

    from hybridflow.runtime.batch import Batch
    from hybridflow.runtime.protocols import SamplingParams
    from hybridflow.runtime.servers import FleetDownError
    from hybridflow.runtime.worker import rollout_metrics

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"eos_token_id": 2, "pad_token_id": 0}')
    monkeypatch.setattr(server, "check_vllm_server", lambda: None)
    monkeypatch.setattr(server, "materialize_model", lambda model, seed: (str(model_dir), None))
    monkeypatch.setattr(server, "server_command", lambda **kw: lambda i, port: [sys.executable, FAKE, str(port),
                                                                                  "--dev-mode"])
    options = server.ServerOptions(replicas=2, log_dir=str(tmp_path / "logs"), start_timeout_s=60)
    rollout = server.ServerRollout(role_spec(rollout="server"), layout(dp=1), context(), options)
    prompts = Batch({"prompts": torch.tensor([[5, 9 + i] for i in range(8)]), "prompt_mask": torch.ones(8, 2)})
    sampling = SamplingParams(max_new_tokens=2, greedy=True, logprobs=True)
    try:
        rollout.load_weights([("w", torch.zeros(3))])
        lost = rollout.fleet.replicas[0]
        os.killpg(lost.process.pid, signal.SIGKILL)
        lost.process.wait()
        out = rollout.generate(prompts, sampling)
        assert out["responses"].tolist() == [[10 + i, 11 + i] for i in range(8)]
        fresh = rollout.fleet.replicas[0]
        assert fresh.alive and fresh.url != lost.url
        lines = fresh.log_path.read_text().splitlines()
        lines = lines[max(i for i, line in enumerate(lines) if line.startswith("listening on ")) + 1:]
        assert lines[:4] == ["sync /pause -", f"sync /collective_rpc {rollout._snapshot}",
                             "sync /reset_prefix_cache -", "sync /resume -"]  # the last weights, before traffic
        hybrid = type("Hybrid", (), {"rollout": rollout})()  # a hybrid engine's rollout reports through it
        assert rollout.last_sync is not None
        snapshot = len(save({"w": torch.zeros(3)}, metadata={"format": "pt"}))  # the file a replica reads
        assert rollout_metrics(hybrid) == {"rollout/replica_restarts": 1.0,
                                           "rollout/requests_retried": float(rollout.client.retried),
                                           "rollout/sync_s": rollout.last_sync.seconds,
                                           "rollout/sync_bytes": float(snapshot), "rollout/sync_replicas": 2.0}
        assert snapshot > rollout.last_sync.bytes == 12  # the header too, not only the tensor's bytes
        for replica in rollout.fleet.replicas:
            os.killpg(replica.process.pid, signal.SIGKILL)
            replica.process.wait()
        logs = [str(replica.log_path) for replica in rollout.fleet.replicas]
        with pytest.raises(FleetDownError, match=rf"replica-0 .*{logs[0]}.*replica-1 .*{logs[1]}"):
            rollout.generate(prompts, sampling)
    finally:
        rollout.close()


def test_replicas_come_from_the_plan_and_a_disagreement_on_gpus_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The factory sizes each rank's fleet from the plan's rollout layout before anything starts (no vLLM here)."""
    from harness import layout, role_spec
    from hybridflow.backends.vllm import server

    from hybridflow.graph import RoleKind
    from hybridflow.runtime.protocols import WorkerContext

    built: list[int | None] = []
    monkeypatch.setattr(server, "ServerRollout", lambda spec, lay, ctx, options: built.append(options.replicas))
    spec = role_spec("actor:rollout", RoleKind.FROZEN_POLICY, rollout="server")
    plan_layout = layout("actor:rollout", dp=4, sharding=Sharding.NO_SHARD)

    def on(device: str, world_size: int = 4) -> WorkerContext:
        return WorkerContext(group=1, rank=0, world_size=world_size, device=device, collective=None)  # type: ignore[arg-type]

    server.ROLLOUT.build(spec, plan_layout, on("cuda:0"), trainer=None)
    server.ROLLOUT.build(spec, plan_layout, on("cuda:0", world_size=1), trainer=None)
    assert built == [1, 4]  # one replica per rank, or the rank's share of the plan's four
    asked = role_spec("actor:rollout", RoleKind.FROZEN_POLICY, rollout="server", rollout_options={"replicas": 2})
    with pytest.raises(ValueError, match=r"role 'actor': its rollout option replicas=2 disagrees with the plan"):
        server.ROLLOUT.build(asked, plan_layout, on("cuda:0"), trainer=None)
    server.ROLLOUT.build(asked, plan_layout, on("cpu"), trainer=None)  # logical GPUs: processes sharing the cores
    assert built[-1] == 2
