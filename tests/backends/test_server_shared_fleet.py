"""The role's one fleet (``rollout_options.fleet``): two ranks of a served rollout, as the local executor runs them
(threads meeting in a collective), share the replicas and the router rank 0 starts; fake replicas, the real router."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import layout, role_spec

from hybridflow.graph import RoleKind
from hybridflow.planner import Sharding
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.collective import ThreadGroup
from hybridflow.runtime.protocols import SamplingParams, WorkerContext
from hybridflow.runtime.servers import ServerStartError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm_router") is None,
                                reason="needs vllm-router (hybridflow[servers])")

FAKE = str(Path(__file__).parents[1] / "runtime" / "fake_openai_server.py")
PROMPTS = Batch({"prompts": torch.tensor([[5, 9 + i] for i in range(8)]), "prompt_mask": torch.ones(8, 2)})
# 32 distinct prompts a rank, 64 sessions in all: the router's hash leaves no replica idle (p < 1e-12; it split 64
# sessions 24/40 at worst over three port pairs, docs/benchmarks.md "Rollout servers").
SPREAD = [Batch({"prompts": torch.tensor([[5 + rank, 9 + i] for i in range(32)]), "prompt_mask": torch.ones(32, 2)})
          for rank in range(2)]
GREEDY = SamplingParams(max_new_tokens=2, greedy=True)


def on_both_ranks(call: Callable[[int], Any]) -> list[Any]:
    """``call(rank)`` on two threads at once, as the local executor runs a group's ranks; every rank's result or
    exception."""
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(call, rank) for rank in range(2)]
        return [future.exception(timeout=180) or future.result() for future in futures]


def build_two_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str] | None = None,
                    **options: Any) -> list[Any]:
    from hybridflow.backends.vllm import server

    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text('{"eos_token_id": 2, "pad_token_id": 0}')
    monkeypatch.setattr(server, "check_vllm_server", lambda: None)
    monkeypatch.setattr(server, "materialize_model", lambda model, seed: (str(model_dir), None))
    monkeypatch.setattr(server, "server_command", lambda **kw: lambda i, port: command or [
        sys.executable, FAKE, str(port), "--dev-mode"])
    spec = role_spec("actor:rollout", RoleKind.FROZEN_POLICY, rollout="server", rollout_options={
        "replicas": 2, "log_dir": str(tmp_path / "logs"), "start_timeout_s": 60, **options})
    group = ThreadGroup(2, timeout_s=60)

    def build(rank: int) -> Any:
        context = WorkerContext(group=1, rank=rank, world_size=2, device="cpu", collective=group.member(rank))
        return server.ROLLOUT.build(spec, layout("actor:rollout", dp=2, sharding=Sharding.NO_SHARD), context,
                                    trainer=None)
    return on_both_ranks(build)


def served_by(log: Path) -> int:
    return sum(line == "served" for line in log.read_text().splitlines())


def test_two_ranks_share_one_fleet_and_one_router_and_the_leader_syncs_it(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    leader, follower = build_two_ranks(tmp_path, monkeypatch)
    try:
        assert leader.leads and not follower.leads and follower.fleet is None
        assert len(leader.fleet.replicas) == 2  # the role's two, not two per rank
        assert follower.client.base_url == leader.fleet.url  # one router for the role
        outs = on_both_ranks(lambda rank: (leader, follower)[rank].generate(SPREAD[rank], GREEDY))
        assert [out["responses"].tolist() for out in outs] == [[[10 + i, 11 + i] for i in range(32)]] * 2
        logs = tmp_path / "logs"
        assert served_by(logs / "replica-0.log") + served_by(logs / "replica-1.log") == 64  # both ranks' rows
        assert min(served_by(logs / "replica-0.log"), served_by(logs / "replica-1.log")) > 0  # spread over both
        on_both_ranks(lambda rank: (leader, follower)[rank].load_weights([("w", torch.ones(3))]))
        syncs = [line for name in ("replica-0.log", "replica-1.log") for line in (logs / name).read_text().splitlines()
                 if line.startswith("sync /collective_rpc")]
        assert len(syncs) == 2  # each replica reloaded once, by the leader: the follower's copy is not sent
        outs = on_both_ranks(lambda rank: (leader, follower)[rank].generate(PROMPTS, GREEDY))
        assert [out["policy_version"].tolist() for out in outs] == [[1] * 8] * 2
        assert "rollout/replica_restarts" not in follower.rollout_metrics()  # the leader's alone count in the mean
    finally:
        on_both_ranks(lambda rank: (leader, follower)[rank].close())


def test_a_replica_lost_mid_run_is_restarted_by_the_leader_and_the_followers_rows_still_complete(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    leader, follower = build_two_ranks(tmp_path, monkeypatch)
    try:
        on_both_ranks(lambda rank: (leader, follower)[rank].load_weights([("w", torch.ones(3))]))
        lost = leader.fleet.replicas[1]
        os.killpg(lost.process.pid, signal.SIGKILL)
        lost.process.wait()
        outs = on_both_ranks(lambda rank: (leader, follower)[rank].generate(PROMPTS, GREEDY))
        assert all(not isinstance(out, BaseException) for out in outs), outs
        assert [len(out["responses"]) for out in outs] == [8, 8]
        assert leader.fleet.restarts == 1 and leader.fleet.versions == {"replica-0": 1, "replica-1": 1}
        assert leader.rollout_metrics()["rollout/replica_restarts"] == 1.0
    finally:
        on_both_ranks(lambda rank: (leader, follower)[rank].close())


def test_a_leader_that_cannot_start_the_fleet_fails_its_followers_with_its_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failed = build_two_ranks(tmp_path, monkeypatch, command=[sys.executable, "-c", "raise SystemExit(3)"])
    assert isinstance(failed[0], ServerStartError)
    assert isinstance(failed[1], RuntimeError)
    assert str(failed[1]).startswith("rank 0, which runs the role's rollout servers, failed: ServerStartError: ")
    assert "replica-0.log" in str(failed[1])  # the leader's error names the log to read


def test_ranks_on_two_machines_run_a_fleet_each_unless_one_fleet_is_asked(tmp_path: Path) -> None:
    from hybridflow.runtime.servers.shared import RankPlace, join_role_fleet

    class TwoMachines:
        rank, world_size = 0, 2

        def all_gather_object(self, value: RankPlace) -> list[RankPlace]:
            return [value, RankPlace(host="other-machine")]

    context = WorkerContext(group=1, rank=0, world_size=2, device="cpu", collective=TwoMachines())  # type: ignore[arg-type]
    assert join_role_fleet(context, mode=None, log_dir=str(tmp_path), role="actor") is None
    with pytest.raises(ValueError, match=r"role 'actor': rollout_options.fleet=role .* on 2 machines .* fleet: rank"):
        join_role_fleet(context, mode="role", log_dir=str(tmp_path), role="actor")
    assert join_role_fleet(context, mode="rank", log_dir=str(tmp_path), role="actor") is None


def _join_over_gloo(rank: int, world_size: int, log_dir: str) -> tuple[bool, str, str | None]:
    from hybridflow.runtime.collective import ProcessGroupCollective
    from hybridflow.runtime.servers.shared import join_role_fleet

    collective = ProcessGroupCollective(rank=rank, world_size=world_size)
    context = WorkerContext(group=1, rank=rank, world_size=world_size, device="cpu", collective=collective)
    shared = join_role_fleet(context, mode=None, log_dir=log_dir if rank == 0 else None, role="actor")
    assert shared is not None
    return shared.leader, shared.log_dir, shared.state.read() and "stale"


def test_ranks_in_processes_agree_on_the_leaders_fleet_through_their_process_group(tmp_path: Path) -> None:
    """Ray's and torchrun's ranks gather over their gloo group: each learns the leader's log directory (where
    its state file goes); a state file left by an earlier run there is cleared before anyone can read it."""
    from harness import run_ranks

    (tmp_path / "fleet.json").write_text('{"url": "http://127.0.0.1:1", "version": 9}')
    results = run_ranks(_join_over_gloo, str(tmp_path))
    assert results == [(True, str(tmp_path), None), (False, str(tmp_path), None)]
