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
CUT = 1  # the gate opens once this many steps are logged: the next step's first reward call pauses
QUICK = ["model.sft_steps=0", "data.batch_size=4", "data.num_examples=16", "algorithm_options.n=2",
         "algorithm_options.max_new_tokens=6", "progress=false", "tensorboard=false", "plot=false", "trackers=[]",
         f"steps={STEPS}", "checkpoint_every=100"]
REWARDS = '''
import os, time

def gated(response, ground_truth):
    """Once the gate file exists, the first call on a real sample marks it and pauses; every call scores alike."""
    if response != ground_truth and os.path.exists(os.environ["HF_TEST_GATE"]):
        try:
            os.close(os.open(os.environ["HF_TEST_MARKER"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass
        else:
            time.sleep(float(os.environ["HF_TEST_PAUSE_S"]))
    return (len(response) % 4) / 3
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
TIMED = ("time/", "memory/", "throughput/")


@pytest.fixture(scope="module")
def rewards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("preemption") / "rewards.py"
    path.write_text(REWARDS)
    return path


@pytest.fixture(scope="module")
def uninterrupted(rewards: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The metrics of the run no signal interrupts (the gate never opens)."""
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_TEST_GATE", str(run / "no-gate"))
        env.setenv("HF_TEST_MARKER", str(run / "no-marker"))
        env.setenv("HF_TEST_PAUSE_S", "0")
        assert main(["train", *QUICK, f"output_dir={run}", f"data.reward={rewards}:gated"]) == 0
    return _rows(run)


def _rows(run: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(TIMED)} for row in rows]


def _preempted(tmp_path: Path, rewards: Path, *words: str, pause_s: float, script: str = CLI
               ) -> tuple[int, str, float]:
    """Start a run, open the gate once CUT steps are logged, SIGTERM it once the next step's reward pauses;
    returns the exit code, stderr and the seconds from the signal to the exit."""
    run, gate, marker = tmp_path / "run", tmp_path / "gate", tmp_path / "marker"
    env = {**os.environ, "HF_TEST_GATE": str(gate), "HF_TEST_MARKER": str(marker), "HF_TEST_PAUSE_S": str(pause_s),
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", script, *(["train"] if script == CLI else []), *QUICK, f"output_dir={run}",
               f"data.reward={rewards}:gated", *words]
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while process.poll() is None and time.monotonic() < deadline and not (
                (run / "metrics.jsonl").is_file() and len((run / "metrics.jsonl").read_text().splitlines()) >= CUT):
            time.sleep(0.1)
        gate.touch()
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


def _resumed_equals(tmp_path: Path, rewards: Path, uninterrupted: list[dict[str, Any]], *words: str) -> None:
    run = tmp_path / "run"
    assert main(["train", "--resume", *QUICK, f"output_dir={run}", f"data.reward={rewards}:gated", *words]) == 0
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
    code, err, _ = _preempted(tmp_path, rewards, f"executor={executor}", pause_s=2)
    assert code == 143, err
    assert "Traceback" not in err, err
    done = CUT + 1  # the step SIGTERM interrupted finished
    assert (f"hybridflow train: error: terminated (SIGTERM) after {done} of {STEPS} steps: checkpoint "
            f"step_{done:06d} written; resume with --resume") in err, err
    _intact_checkpoint(tmp_path / "run", done)
    monkeypatch.setenv("HF_TEST_GATE", str(tmp_path / "gate"))  # open, and its one pause spent (marker exists)
    monkeypatch.setenv("HF_TEST_MARKER", str(tmp_path / "marker"))
    _resumed_equals(tmp_path, rewards, uninterrupted)


def test_a_step_past_the_grace_is_abandoned_and_the_one_before_it_checkpointed(
        rewards: Path, uninterrupted: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, err, seconds = _preempted(tmp_path, rewards, "sigterm_grace_s=1", pause_s=600)
    assert code == 143, err
    assert seconds < 30, seconds  # neither the reward's pause nor its data.reward_timeout_s (60 s) was waited out
    assert (f"hybridflow train: error: terminated (SIGTERM) while step {CUT + 1}/{STEPS} ran: it did not finish "
            f"within sigterm_grace_s=1 and was abandoned; checkpoint step_{CUT:06d} written; resume with --resume"
            ) in err, err
    _intact_checkpoint(tmp_path / "run", CUT)
    monkeypatch.setenv("HF_TEST_GATE", str(tmp_path / "gate"))
    monkeypatch.setenv("HF_TEST_MARKER", str(tmp_path / "marker"))
    _resumed_equals(tmp_path, rewards, uninterrupted)


@pytest.mark.ray
@pytest.mark.slow
def test_under_ray_the_python_api_raises_terminated_after_the_checkpoint_not_system_exit(
        rewards: Path, tmp_path: Path) -> None:
    """A script that started Ray itself (ray.init installs a SIGTERM handler calling sys.exit) and calls train():
    SIGTERM ends train() with Terminated after the checkpoint, and Ray's handler is back afterwards."""
    pytest.importorskip("ray")
    code, err, _ = _preempted(tmp_path, rewards, "executor=ray", pause_s=2, script=API)
    assert code == 143, err
    assert "SystemExit" not in err and "Traceback" not in err, err
    assert f"Terminated: after {CUT + 1} of {STEPS} steps: checkpoint step_{CUT + 1:06d} written" in err, err
    _intact_checkpoint(tmp_path / "run", CUT + 1)
