"""An ``openai`` SDK agent whose turns are served by ``rollout: server`` (fake replicas behind the real vllm-router):
the agent sees one base URL, the trajectory trains on exactly the token ids and log-probs the replicas returned,
and every turn of a trajectory carries the same ``X-Session-ID`` and lands on one replica."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from chat_templates import chat_tokenizer
from openai_agents import HermesLike

from hybridflow.agents.chat import ChatRenderer
from hybridflow.agents.loop import AgentSettings, run_trajectories
from hybridflow.agents.openai_agent import OpenAIAgentEnvironment
from hybridflow.agents.openai_endpoint import openai_endpoint
from hybridflow.agents.protocols import EnvRecord
from hybridflow.agents.server import turn_server
from hybridflow.graph import RoleKind
from hybridflow.planner import RoleLayout, Sharding
from hybridflow.runtime.agent_rollout import trajectory_batch
from hybridflow.runtime.protocols import RoleSpec, SamplingParams, WorkerContext
from hybridflow.runtime.worker import SoloCollective

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(importlib.util.find_spec("vllm_router") is None,
                                 reason="needs vllm-router (hybridflow[servers])")]
FAKE = str(Path(__file__).parents[1] / "runtime" / "fake_openai_server.py")
ROWS = 16


def agent(client: Any, record: EnvRecord) -> float:
    """Three requests, each repeating the conversation so far (the SDK's own message objects) plus a user turn."""
    messages: list[Any] = [{"role": "user", "content": str(record.prompt)}]
    for follow_up in ("more", "again", "done"):
        reply = client.chat.completions.create(model="policy", messages=messages)
        messages += [reply.choices[0].message, {"role": "user", "content": follow_up}]
    return 0.5


def served_turns(log_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Every turn each replica served, as it logged it (``replica-<i>.log``: session, prompt, ids, log-probs)."""
    return {log.name: [json.loads(line[len("turn "):]) for line in log.read_text().splitlines()
                       if line.startswith("turn ")] for log in sorted(log_dir.glob("replica-*.log"))}


def test_an_sdk_agent_served_through_the_router_trains_on_the_replicas_tokens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridflow.backends.vllm import server

    tokenizer, end = chat_tokenizer("qwen2")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"eos_token_id": end, "pad_token_id": 0}))
    monkeypatch.setattr(server, "check_vllm_server", lambda: None)
    monkeypatch.setattr(server, "materialize_model", lambda model, seed: (str(model_dir), None))
    monkeypatch.setattr(server, "server_command",
                        lambda **kw: lambda i, port: [sys.executable, FAKE, str(port), "--end-id", str(end)])
    logs = tmp_path / "logs"
    spec = RoleSpec(name="actor", kind=RoleKind.FROZEN_POLICY, model="tiny-qwen2", rollout="server")
    rollout = server.ServerRollout(
        spec, RoleLayout(role="actor", dp=1, sharding=Sharding.NO_SHARD, dtype="fp32", micro_batch_size=1),
        WorkerContext(group=0, rank=0, world_size=1, device="cpu", collective=SoloCollective()),
        server.ServerOptions(replicas=2, log_dir=str(logs), start_timeout_s=60))
    renderer = ChatRenderer(tokenizer, turn_end_id=end)
    envs: list[OpenAIAgentEnvironment] = []

    def make_env(record: EnvRecord) -> OpenAIAgentEnvironment:
        envs.append(OpenAIAgentEnvironment(agent, tool_format=HermesLike(), request_timeout_s=30))
        return envs[-1]

    records = [EnvRecord(index=i, prompt=f"What is 12*{i}?") for i in range(ROWS)]
    try:
        with rollout.turn_session(SamplingParams(max_new_tokens=16, temperature=1.0, logprobs=True)) as generate, \
                turn_server(generate) as turns:
            trajectories = run_trajectories(records, [[0]] * ROWS, server=turns, renderer=renderer,
                                            make_env=make_env, environment="openai_agent", seeds=list(range(ROWS)),
                                            settings=AgentSettings(max_turns=3, max_turn_tokens=16, max_tokens=400))
    finally:
        rollout.close()
    served = served_turns(logs)
    assert len(served) == 2 and all(served.values()), "both replicas should serve some of 16 trajectories"
    assert {env.base_url.split("/t/")[0] for env in envs} == {openai_endpoint().url}  # one endpoint, in front
    batch = trajectory_batch(trajectories, pad=0)
    for row, (trajectory, env) in enumerate(zip(trajectories, envs, strict=True)):
        assert (trajectory.turns, trajectory.finished, trajectory.env_reward) == (3, True, 0.5)
        replicas, sessions, start = set(), set(), 0
        for turn in range(3):
            while not trajectory.sampled[start]:  # skip the templated observation (no loss)
                start += 1
            context = [*trajectory.prompt_ids, *trajectory.tokens[:start]]
            (replica, logged), = [(name, t) for name, lines in served.items() for t in lines if t["prompt"] == context]
            width = len(logged["ids"])
            assert trajectory.tokens[start:start + width] == logged["ids"]  # the ids as returned, not re-tokenised
            assert all(trajectory.sampled[start:start + width])
            assert trajectory.logprobs[start:start + width] == logged["logprobs"]
            assert batch["rollout_logprobs"][row, start:start + width].tolist() == \
                pytest.approx(logged["logprobs"], abs=1e-7)
            assert env.requests[turn].completion_ids == tuple(logged["ids"])
            replicas.add(replica)
            sessions.add(logged["session"])
            start += width
        assert not any(trajectory.sampled[start:])  # nothing trained on that no replica returned
        assert len(sessions) == 1 and None not in sessions  # one X-Session-ID for the trajectory's turns...
        assert len(replicas) == 1  # ...so one replica served them all
    assert len({next(t["session"] for lines in served.values() for t in lines if t["prompt"][:len(tr.prompt_ids)]
                     == tr.prompt_ids) for tr in trajectories}) == ROWS  # a key per trajectory
    assert torch.equal(batch["loss_mask"].sum(1), torch.full((ROWS,), 12))  # 3 turns x 4 ids each
