"""The torchrun path: one process per logical GPU, rank 0 the controller, gloo on CPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.graph import RoleKind, load_graph
from hybridflow.planner import GroupPlan, Plan, RoleLayout
from hybridflow.runtime import RuntimeStepError, WorkerFailedError, default_plan
from hybridflow.runtime.torchrun_executor import TorchrunExecutor, check_plan_fits
from hybridflow.runtime.torchrun_protocol import RemoteError, current_world
from hybridflow.train import setup
from hybridflow.train.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "ppo_torchrun.yaml"
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "GROUP_RANK")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    return {**env, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **extra}


def _tail(text: str) -> str:
    return text[-3000:]


@pytest.mark.slow
def test_torchrun_trains_ppo_with_the_actor_data_parallel_over_two_processes(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--standalone", "--nproc_per_node=2", str(ROOT / "examples" / "train_ppo.py"),
               "--config", str(CONFIG), "steps=2", f"output_dir={tmp_path}", "model.sft_steps=0"]
    done = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, _tail(done.stdout + done.stderr)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert "actor/loss" in rows[0] and "critic/loss" in rows[0]
    workers = json.loads((tmp_path / "torchrun_workers.json").read_text())
    assert [(w["group"], w["rank"], w["global_rank"]) for w in workers] == [(0, 0, 0), (0, 1, 1)]
    assert all("actor" in w["roles"] for w in workers)
    assert len({w["pid"] for w in workers}) == 2, "both ranks of the actor ran in one process"
    assert os.getpid() not in {w["pid"] for w in workers}


@pytest.mark.slow
def test_torchrun_ships_the_actors_weights_to_a_rollout_in_the_other_process(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).parent / "torchrun"
    meshes = "placement.meshes={actor: [0], critic: [0], 'actor:rollout': [1], reference: [1]}"
    command = [str(torchrun), "--standalone", "--nproc_per_node=2", str(ROOT / "examples" / "train_ppo.py"),
               "--config", str(CONFIG), "steps=2", f"output_dir={tmp_path}", "model.sft_steps=0",
               "placement.mode=manual", "placement.cluster=2xCPU", meshes,
               "algorithm.options.kl_coef=0.05"]  # a KL penalty keeps the reference (kl_coef 0 drops it)
    done = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, _tail(done.stdout + done.stderr)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    workers = json.loads((tmp_path / "torchrun_workers.json").read_text())
    assert [sorted(w["roles"]) for w in workers] == [["actor", "critic"], ["actor:rollout", "reference"]]
    for row in rows:  # every step's update reached the rollout: the plan's params x dtype
        assert abs(row["actor/weight_sync/bytes"] / row["weight_sync/planned_bytes"] - 1) < 0.01


def test_a_hand_started_world_keeps_replicas_equal_and_reports_failures_by_rank(tmp_path: Path) -> None:
    """Two plain processes with torchrun's environment (a launcher would end rank 0 once rank 1 is killed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = Path(__file__).with_name("probe_world.py")
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for rank in range(2)]
    try:
        out, _ = procs[0].communicate(timeout=90)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert procs[0].returncode == 0, _tail(out)
    result = json.loads((tmp_path / "result.json").read_text())
    assert len(set(result["pids"])) == 2
    assert result["params_moved"], "the probe's updates did not change the actor"
    assert result["replicas_equal"], "the two ranks' actors diverged: gradients were not averaged"
    # One machine: gloo binds loopback (GLOO_SOCKET_IFNAME=lo); only torch's rendezvous store (MASTER_PORT, not
    # ours to bind) listens wider, and it carries no code (docs/security.md).
    gloo = [ip for ip, listen_port in result["listening"] if listen_port != port]
    assert gloo and set(gloo) == {"127.0.0.1"}, result["listening"]
    assert result["gloo_interface"] == "lo"  # set by init_world (here the hostname resolves to loopback anyway)
    assert result["remote_error"]["type"] == "KeyError"
    assert "torchrun rank 1 (role 'actor' rank 1, group 0, node 'actor_logprob')" in result["remote_error"]["notes"][0]
    assert result["in_sync_after_error"]
    hung = result["hung"]
    assert hung["rank"] == 1 and "torchrun rank 1 unreachable" in hung["message"] and "no heartbeat" in hung["message"]
    # heartbeat_timeout_s=2 (+ a poll) in the probe: well before the ops' own 8 s timeout
    assert 1.5 < hung["seconds"] < 6.0, "a stopped rank must fail the call once its heartbeat stalls"
    print(f"stopped torchrun rank seen after {hung['seconds']:.1f}s (heartbeat_timeout_s=2)")
    assert "lost a rank earlier" in result["after_lost"]
    assert result["stop_serving_seconds"] < 2.0


def test_a_plan_gpu_beyond_the_world_is_named_with_the_world_size() -> None:
    plan = default_plan(load_graph("grpo", reward_kind=RoleKind.REWARD_FUNCTION), num_gpus=3)
    check_plan_fits(plan, 3)
    with pytest.raises(ValueError, match=r"uses GPU 2 but torchrun started a world of 2 process\(es\)"):
        check_plan_fits(plan, 2)
    layout = RoleLayout(role="actor", dp=1, dtype="fp32", micro_batch_size=1)
    lone = Plan(algorithm="x", groups=(GroupPlan(gpus=(5,), hosts=(0,), device="cpu", roles=("actor",),
                                                 layouts=(layout,), memory_per_gpu_bytes=0, capacity_bytes=0),))
    with pytest.raises(ValueError, match="launch at least 6 processes"):
        check_plan_fits(lone, 4)


def test_a_remote_exception_keeps_its_type_or_falls_back_to_a_runtime_step_error() -> None:
    try:
        raise ValueError("bad shard")
    except ValueError as err:
        captured = RemoteError.capture(err)
    with pytest.raises(ValueError, match="bad shard") as info:
        captured.reraise(where="torchrun rank 3 (role 'critic' rank 1)", node="critic_values")
    assert "raised on torchrun rank 3 (role 'critic' rank 1)" in info.value.__notes__[0]
    assert "Traceback" in info.value.__notes__[0]
    # hybridflow's own errors cross as themselves; a class from elsewhere crosses as its text only.
    assert isinstance(RemoteError.capture(WorkerFailedError(role="ref", rank=0, group=1, cause="x")).exception,
                      WorkerFailedError)
    foreign = RemoteError.capture(_ForeignError("worker of role 'ref' broke"))
    assert foreign.exception is None
    with pytest.raises(RuntimeStepError, match="torchrun rank 2 raised _ForeignError: worker of role 'ref'"):
        foreign.reraise(where="torchrun rank 2", node="n")


class _ForeignError(Exception):
    """An exception class outside hybridflow: the control plane will not rebuild it on rank 0."""


def test_config_selects_the_torchrun_executor_which_needs_a_torchrun_world(tmp_path: Path) -> None:
    config = load_config(CONFIG, [f"output_dir={tmp_path}"])
    executor = setup.make_executor(config)
    assert isinstance(executor, TorchrunExecutor)
    assert executor.info_path == str(tmp_path / "torchrun_workers.json")
    with pytest.raises(RuntimeError, match=r"launch `torchrun --nproc_per_node=N examples/train_ppo\.py"):
        current_world()
    with pytest.raises(ValueError, match="must be one of"):
        load_config(CONFIG, ["executor.name=mpi"])


SLEEPY_REWARD = '''
import os, time
def marks_then_sleeps(response, ground_truth):
    if response != ground_truth:
        open(os.environ["HF_TEST_MARKER"], "w").close()
        time.sleep(600)
    return 1.0
'''


@pytest.mark.slow
def test_sigterm_to_a_torchrun_job_stops_it_like_ctrl_c(tmp_path: Path) -> None:
    """torchrun forwards SIGTERM to every rank: rank 0 stops the run and says so in one line, the serving rank
    waits for rank 0's word instead of vanishing mid-call; neither prints a traceback (torchrun prints its own)."""
    import signal
    import time

    (tmp_path / "rewards.py").write_text(SLEEPY_REWARD)
    marker = tmp_path / "scoring"
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--standalone", "--nproc_per_node=2", str(ROOT / "examples" / "train_ppo.py"),
               "--config", str(CONFIG), "steps=1", f"output_dir={tmp_path / 'run'}", "model.sft_steps=0",
               "data.batch_size=4", "data.num_examples=16", f"data.reward={tmp_path / 'rewards.py'}:marks_then_sleeps",
               "checkpoint.sigterm_grace_s=1"]  # rank 0 abandons the hung step after 1 s, well inside torchrun's 30 s
    process = subprocess.Popen(command, cwd=tmp_path, env=_env(HF_TEST_MARKER=str(marker)), text=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), f"the run never reached its first reward: {_tail(process.communicate()[1])}"
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            process.kill()
    assert "hybridflow train (torchrun rank 0): error: terminated (SIGTERM)" in err, _tail(err)
    assert "train_ppo.py" not in err and err.count("Traceback") <= 1, _tail(err)  # torchrun's own, no rank's
