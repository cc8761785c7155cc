"""A preemption loses at most the step in flight: SIGTERM to a run whose next checkpoint is far off lets the step
finish (or abandons it past ``sigterm_grace_s``), checkpoints the last finished step, exits 143, and ``--resume``
ends where the uninterrupted run ends, metric for metric."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hybridflow.cli import main
from hybridflow.train.checkpoint import latest_checkpoint
from hybridflow.train.file_checks import checkpoint_problem

pytestmark = pytest.mark.timeout(240)

STEPS = 3
CUT = 1  # the first reward call of step CUT + 1 (1-based) pauses: SIGTERM reaches the run there
ROWS = 4 * 2  # data.batch_size x algorithm.options.n: reward calls a step
QUICK = ["model.sft_steps=0", "data.batch_size=4", "data.num_examples=16", "algorithm.options.n=2",
         "algorithm.options.max_new_tokens=6", "logging.progress=false", "logging.plot=false", "logging.trackers=[]",
         f"steps={STEPS}", "checkpoint.every=100"]
REWARDS = '''
import os, time

def paused(response, ground_truth):
    """Call number HF_TEST_PAUSE_AT on a real sample (the probe scores the ground truth) marks HF_TEST_MARKER and
    sleeps HF_TEST_PAUSE_S; the calls are counted by files claimed in HF_TEST_CALLS (concurrent callers too)."""
    if response != ground_truth:
        calls = os.environ["HF_TEST_CALLS"]
        os.makedirs(calls, exist_ok=True)
        index = len(os.listdir(calls))
        while True:
            try:
                os.close(os.open(os.path.join(calls, str(index)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                break
            except FileExistsError:
                index += 1
        if index == int(os.environ["HF_TEST_PAUSE_AT"]):
            open(os.environ["HF_TEST_MARKER"], "w").close()
            time.sleep(float(os.environ["HF_TEST_PAUSE_S"]))
    return (sum(map(ord, response)) % 7) / 6  # varies within a group: the policy trains
'''
CLI = "import sys; from hybridflow.cli import main; sys.exit(main(sys.argv[1:]))"
API = """
import signal, sys
from hybridflow.runtime.ray_executor import ensure_ray
from hybridflow.train.config import load_config
from hybridflow.train.loop import train
from hybridflow.train.signals import Terminated, is_ray_handler

ensure_ray(address=None, num_gpus=1, num_cpus=2)  # a script's own ray.init: Ray's sys.exit handler is installed
assert is_ray_handler(signal.getsignal(signal.SIGTERM))
try:
    train(load_config(None, sys.argv[1:]))
except Terminated as err:
    print(f"Terminated: {err}", file=sys.stderr)
    assert is_ray_handler(signal.getsignal(signal.SIGTERM)), "Ray's handler was not put back"
    sys.exit(143)
"""
TIMED = ("time/", "timeline/", "memory/", "throughput/")


@pytest.fixture(scope="module")
def rewards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("preemption") / "rewards.py"
    path.write_text(REWARDS)
    return path


@pytest.fixture(scope="module")
def uninterrupted(rewards: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The metrics of the run no signal interrupts (no reward call pauses)."""
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_TEST_CALLS", str(run.parent / "calls"))
        env.setenv("HF_TEST_MARKER", str(run.parent / "marker"))
        env.setenv("HF_TEST_PAUSE_AT", "-1")
        env.setenv("HF_TEST_PAUSE_S", "0")
        assert main(["train", *QUICK, f"output_dir={run}", f"data.reward={rewards}:paused"]) == 0
    return _rows(run)


def _rows(run: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(TIMED)} for row in rows]


def _preempted(tmp_path: Path, rewards: Path, *words: str, pause_s: float, script: str = CLI
               ) -> tuple[int, str, float]:
    """Start a run and SIGTERM it once step CUT + 1's first reward call pauses; returns the exit code, stderr and
    the seconds from the signal to the exit."""
    run, marker = tmp_path / "run", tmp_path / "marker"
    env = {**os.environ, "HF_TEST_CALLS": str(tmp_path / "calls"), "HF_TEST_MARKER": str(marker),
           "HF_TEST_PAUSE_AT": str(CUT * ROWS), "HF_TEST_PAUSE_S": str(pause_s), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", script, *(["train"] if script == CLI else []), *QUICK, f"output_dir={run}",
               f"data.reward={rewards}:paused", *words]
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), f"the run never reached step {CUT + 1}'s reward: {process.communicate()[1]}"
        process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, err, time.monotonic() - sent


def _resumed_equals(tmp_path: Path, rewards: Path, uninterrupted: list[dict[str, Any]],
                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``--resume`` (in this process, no reward call pausing) ends with the uninterrupted run's metrics."""
    run = tmp_path / "run"
    monkeypatch.setenv("HF_TEST_CALLS", str(tmp_path / "calls"))
    monkeypatch.setenv("HF_TEST_MARKER", str(tmp_path / "marker"))
    monkeypatch.setenv("HF_TEST_PAUSE_AT", "-1")
    monkeypatch.setenv("HF_TEST_PAUSE_S", "0")
    assert main(["train", "--resume", *QUICK, f"output_dir={run}", f"data.reward={rewards}:paused"]) == 0
    assert _rows(run) == uninterrupted


def _intact_checkpoint(run: Path, done: int) -> None:
    checkpoint = latest_checkpoint(run)
    assert checkpoint is not None and checkpoint.name == f"step_{done:06d}", checkpoint
    assert checkpoint_problem(checkpoint) is None
    assert (checkpoint / "hf" / "model.safetensors").is_file()
    assert not list((run / "checkpoints").glob(".*.tmp")), "a temporary checkpoint directory was left"
    assert len(_rows(run)) == done  # every finished step is logged, and no other


@pytest.mark.parametrize("executor", ["local", pytest.param("ray", marks=[pytest.mark.ray, pytest.mark.slow])])
def test_sigterm_finishes_the_step_in_flight_checkpoints_it_and_resume_continues_exactly(
        executor: str, rewards: Path, uninterrupted: list[dict[str, Any]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if executor == "ray":
        pytest.importorskip("ray")
    code, err, _ = _preempted(tmp_path, rewards, f"executor.name={executor}", pause_s=2)
    assert code == 143, err
    assert "Traceback" not in err, err
    done = CUT + 1  # the step SIGTERM interrupted finished
    assert (f"hybridflow train: error: terminated (SIGTERM) after {done} of {STEPS} steps: checkpoint "
            f"step_{done:06d} written; resume with --resume") in err, err
    _intact_checkpoint(tmp_path / "run", done)
    _resumed_equals(tmp_path, rewards, uninterrupted, monkeypatch)


def test_a_step_past_the_grace_is_abandoned_and_the_one_before_it_checkpointed(
        rewards: Path, uninterrupted: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, err, seconds = _preempted(tmp_path, rewards, "checkpoint.sigterm_grace_s=1", pause_s=600)
    assert code == 143, err
    assert seconds < 30, seconds  # neither the reward's pause nor its data.reward_timeout_s (60 s) was waited out
    assert (f"hybridflow train: error: terminated (SIGTERM) while step {CUT + 1}/{STEPS} ran: it did not finish "
            f"within sigterm_grace_s=1 and was abandoned; checkpoint step_{CUT:06d} written; resume with --resume"
            ) in err, err
    _intact_checkpoint(tmp_path / "run", CUT)
    _resumed_equals(tmp_path, rewards, uninterrupted, monkeypatch)


@pytest.mark.ray
@pytest.mark.slow
def test_under_ray_the_python_api_raises_terminated_after_the_checkpoint_not_system_exit(
        rewards: Path, tmp_path: Path) -> None:
    """A script that started Ray itself (ray.init installs a SIGTERM handler calling sys.exit) and calls train():
    SIGTERM ends train() with Terminated after the checkpoint, and Ray's handler is back afterwards."""
    pytest.importorskip("ray")
    code, err, _ = _preempted(tmp_path, rewards, "executor.name=ray", pause_s=2, script=API)
    assert code == 143, err
    assert "SystemExit" not in err and "Traceback" not in err, err
    assert f"Terminated: after {CUT + 1} of {STEPS} steps: checkpoint step_{CUT + 1:06d} written" in err, err
    _intact_checkpoint(tmp_path / "run", CUT + 1)


def test_reward_workers_outlive_a_sigterm_to_the_process_group(rewards: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun (and ``kill -- -PGID``) SIGTERMs a rank's whole process group: the reward processes leave the
    signal to the driver, which needs them to finish the step in flight, and kills them when it closes the pool."""
    from hybridflow.data.reward_functions import Sample
    from hybridflow.data.reward_pool import RewardPool
    from hybridflow.data.reward_specs import load_reward_functions

    monkeypatch.setenv("HF_TEST_CALLS", str(tmp_path / "calls"))
    monkeypatch.setenv("HF_TEST_PAUSE_AT", "-1")
    pool = RewardPool(load_reward_functions(f"{rewards}:paused"), timeout_s=60, workers=1)
    try:
        sample = Sample(index=0, prompt="p", prompt_text="p", response="abc", ground_truth="x")
        assert pool.score([sample]) == [[(sum(map(ord, "abc")) % 7) / 6]]
        for worker in pool._started:
            worker.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert all(worker.process.poll() is None for worker in pool._started)
        assert pool.score([sample]) == [[(sum(map(ord, "abc")) % 7) / 6]]
    finally:
        pool.close()
    for worker in pool._started:
        assert worker.process.wait(timeout=10) == -signal.SIGKILL
