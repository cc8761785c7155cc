"""Deadlines on user code and remote connects: a hung reward function, environment or cluster address fails the
run with one line naming the function (or environment, or address), the sample and the step, never a hang;
``SystemExit`` and other ``BaseException``s from user code are named errors, not a silent exit."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridflow.cli import main

pytestmark = pytest.mark.timeout(150)

QUICK = ["model.sft_steps=0", "data.batch_size=4", "data.num_examples=16", "algorithm.options.n=2",
         "algorithm.options.max_new_tokens=4", "logging.progress=false", "logging.plot=false", "logging.trackers=[]",
         "steps=1"]
REWARDS = '''
import os, sys, time

class Quit(BaseException):
    pass

def sleeps(response, ground_truth):
    time.sleep(600)
    return 1.0

def sleeps_on_real_samples(response, ground_truth):
    if response != ground_truth:  # the start-up probe scores the ground truth as the response
        time.sleep(600)
    return 1.0

def sleeps_batched(prompts, completions, **columns):
    time.sleep(600)
    return [1.0] * len(completions)

def exits(response, ground_truth):
    sys.exit(3)

def exits_on_real_samples(response, ground_truth):
    if response != ground_truth:
        sys.exit(0)
    return 1.0

def raises_base_exception(response, ground_truth):
    raise Quit("not an Exception")

def marks_then_sleeps(response, ground_truth):
    if response != ground_truth:
        open(os.environ["HF_TEST_MARKER"], "w").close()
        time.sleep(600)
    return 1.0

def fine(response, ground_truth):
    return float(response == ground_truth)

def needs_solution(completions, solution):
    return [float(c == s) for c, s in zip(completions, solution)]
'''


@pytest.fixture(scope="module")
def rewards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("deadlines") / "rewards.py"
    path.write_text(REWARDS)
    return path


def _train(capsys: pytest.CaptureFixture[str], tmp_path: Path, *words: str) -> tuple[int, str, float]:
    started = time.monotonic()
    code = main(["train", *QUICK, f"output_dir={tmp_path / 'run'}", *words])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return code, lines[0], time.monotonic() - started


def test_a_reward_that_hangs_at_the_probe_is_refused_before_training(rewards: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, line, seconds = _train(capsys, tmp_path, f"data.reward={rewards}:sleeps", "data.reward_timeout_s=1")
    assert code == 2, line
    assert re.search(r"reward function '.*rewards\.py:sleeps' did not return within data\.reward_timeout_s=1\.0 s "
                     r"on sample 0 \(prompt '.+', response .*checked before training, on row 0", line), line
    assert seconds < 20
    assert not (tmp_path / "run" / "config.json").exists()


def test_a_reward_that_hangs_only_on_real_samples_fails_the_step_naming_it(rewards: Path, tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, line, seconds = _train(capsys, tmp_path, f"data.reward={rewards}:sleeps_on_real_samples",
                                 "data.reward_timeout_s=1")
    assert code == 1, line
    assert re.search(r"reward function '.*:sleeps_on_real_samples' did not return within "
                     r"data\.reward_timeout_s=1\.0 s on sample \d+ \(prompt '.+', response '.*', ground truth '.+'\);"
                     r".*\(during step 0\)", line), line
    assert seconds < 40


def test_a_batched_reward_that_hangs_names_the_batch(rewards: Path) -> None:
    from hybridflow.data import Sample, reward_scorer
    from hybridflow.runtime.errors import RewardTimeoutError

    scorer = reward_scorer(f"{rewards}:sleeps_batched", None, timeout_s=0.5)
    samples = [Sample(index=i, prompt="p", prompt_text="p", response="r", ground_truth="g") for i in range(3)]
    try:
        with pytest.raises(RewardTimeoutError, match=r"'.*:sleeps_batched' did not return .* on a batch of 3 "
                                                     r"samples \(first: sample 0"):
            scorer.score(samples)
    finally:
        scorer.close()


def test_the_pool_replaces_a_killed_process_and_scores_again(rewards: Path) -> None:
    from hybridflow.data import Sample, reward_scorer
    from hybridflow.runtime.errors import RewardTimeoutError

    scorer = reward_scorer([f"{rewards}:fine", f"{rewards}:sleeps_on_real_samples"], None, timeout_s=0.5)
    right = Sample(index=0, prompt="p", prompt_text="p", response="g", ground_truth="g")
    wrong = Sample(index=1, prompt="p", prompt_text="p", response="x", ground_truth="g")
    try:
        with pytest.raises(RewardTimeoutError, match="sample 1"):
            scorer.score([right, wrong])
        assert scorer.score([right, right])[0] == [2.0, 2.0]  # both functions, in a fresh process
    finally:
        scorer.close()


def test_a_batched_reward_missing_a_column_is_named_through_the_pool(rewards: Path) -> None:
    """The missing-column check runs before the function, in the pool's worker: its error reaches the driver
    naming the column (it used to kill the worker, which the driver reported only as a dead process), and the
    pool scores the next batch."""
    from hybridflow.data import Sample, reward_scorer
    from hybridflow.runtime.errors import RewardFunctionError

    scorer = reward_scorer(f"{rewards}:needs_solution", None, timeout_s=5)
    bare = [Sample(index=i, prompt="p", prompt_text="p", response="r", ground_truth="g") for i in range(2)]
    good = [Sample(index=i, prompt="p", prompt_text="p", response="r", ground_truth="g",
                   columns={"solution": s}) for i, s in enumerate(["r", "x"])]
    try:
        with pytest.raises(RewardFunctionError, match=r"needs data column\(s\) \['solution'\]"):
            scorer.score(bare)
        assert scorer.score(good)[0] == [1.0, 0.0]
    finally:
        scorer.close()


@pytest.mark.parametrize(("function", "expected", "pattern"), [
    ("exits", 2, r"reward function '.*:exits' raised SystemExit: 3 on sample 0"),
    ("raises_base_exception", 2, r"reward function '.*:raises_base_exception' raised Quit: not an Exception"),
    ("exits_on_real_samples", 1, r"reward function '.*:exits_on_real_samples' raised SystemExit: 0 on sample \d+ "
                                 r".*\(during step 0\)"),
])
def test_sys_exit_in_a_reward_is_an_error_naming_it(function: str, expected: int, pattern: str, rewards: Path,
                                                    tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, line, _ = _train(capsys, tmp_path, f"data.reward={rewards}:{function}")
    assert code == expected, line
    assert re.search(pattern, line), line


def test_reward_timeout_must_be_positive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, line, _ = _train(capsys, tmp_path, "data.reward_timeout_s=0")
    assert code == 2 and "data.reward_timeout_s" in line, line


def _roll(env_factory: object, **settings: float) -> None:
    from hybridflow.agents.chat import ChatRenderer
    from hybridflow.agents.loop import AgentSettings, run_trajectories
    from hybridflow.agents.protocols import EnvRecord, TurnResult
    from hybridflow.agents.server import BatchingTurnServer
    from hybridflow.data import char_tokenizer

    tokenizer = char_tokenizer()
    renderer = ChatRenderer(tokenizer, turn_end_id=tokenizer.eos_token_id)

    def model(requests: list) -> list[TurnResult]:
        return [TurnResult(token_ids=(5, renderer.turn_end_id), logprobs=(-0.5, -0.5), finished=True)
                for _ in requests]

    records = [EnvRecord(index=i, prompt="hi") for i in range(2)]
    with BatchingTurnServer(model) as server:
        run_trajectories(records, [[4, 5]] * 2, server=server, renderer=renderer, make_env=env_factory,
                         environment="stuck", settings=AgentSettings(max_tokens=40, max_turn_tokens=8, **settings),
                         seeds=[0, 1])


class Stuck:
    """An environment that hangs in ``step`` on row ``row`` (or exits there with ``exits``)."""

    def __init__(self, row: int, *, exits: bool = False, step_timeout_s: float | None = None) -> None:
        self.row, self.exits, self.current = row, exits, -1
        if step_timeout_s is not None:
            self.step_timeout_s = step_timeout_s

    def reset(self, record: object) -> list[dict]:
        self.current = record.index  # type: ignore[attr-defined]
        return []

    def step(self, turn: str) -> object:
        from hybridflow.agents.protocols import EnvStep

        if self.current == self.row:
            if self.exits:
                sys.exit(1)
            time.sleep(600)
        return EnvStep(done=True, reward=1.0)

    def close(self) -> None:
        return None


def test_a_hung_environment_fails_the_rollout_naming_it_the_row_and_the_turn() -> None:
    from hybridflow.agents.loop import EnvironmentFailure

    started = time.monotonic()
    with pytest.raises(EnvironmentFailure, match=r"environment 'stuck' did not return from step within 0\.5 s on "
                                                 r"row 1 \(turn 1\)"):
        _roll(lambda record: Stuck(1), env_timeout_s=0.5)
    assert time.monotonic() - started < 10


def test_an_environment_sets_its_own_deadline() -> None:
    from hybridflow.agents.loop import EnvironmentFailure

    with pytest.raises(EnvironmentFailure, match=r"within 0\.3 s on row 0"):
        _roll(lambda record: Stuck(0, step_timeout_s=0.3))


def test_sys_exit_in_an_environment_is_an_environment_failure() -> None:
    from hybridflow.agents.loop import EnvironmentFailure

    with pytest.raises(EnvironmentFailure, match=r"'stuck' raised in step on row 0 \(turn 1\): SystemExit: 1"):
        _roll(lambda record: Stuck(0, exits=True))


def test_sys_exit_in_a_compute_function_names_the_node() -> None:
    from hybridflow.graph import Node, Op
    from hybridflow.registry import COMPUTE_FNS
    from hybridflow.runtime.batch import Batch
    from hybridflow.runtime.controller import _run_compute
    from hybridflow.runtime.errors import RuntimeStepError

    def quits(scores: object) -> object:
        raise SystemExit(4)

    COMPUTE_FNS.add("test_deadlines_quits", quits)
    node = Node(name="advantages", op=Op.COMPUTE, role=None, fn="test_deadlines_quits", inputs=("scores",),
                outputs=("advantages",))
    import torch

    with pytest.raises(RuntimeStepError, match=r"compute node 'advantages': fn 'test_deadlines_quits' raised "
                                               r"SystemExit\(4\)"):
        _run_compute(node, Batch({"scores": torch.zeros(2)}))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_an_unreachable_ray_address_is_refused_at_once_naming_it() -> None:
    pytest.importorskip("ray")
    from hybridflow.runtime.ray_executor import ensure_ray

    address = f"127.0.0.1:{_free_port()}"
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"Ray address '{re.escape(address)}': nothing answers"):
        ensure_ray(address=address, num_gpus=1)
    assert time.monotonic() - started < 15


def test_a_silent_ray_address_times_out_within_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridflow.runtime import ray_executor

    def silent(address: tuple[str, int], timeout: float) -> socket.socket:
        raise TimeoutError("timed out")  # what a firewalled host gives after `timeout`

    monkeypatch.setattr(socket, "create_connection", silent)
    with pytest.raises(ConnectionError, match=r"'ray://10\.0\.0\.9:10001'.*within 10 s"):
        ray_executor.check_reachable("ray://10.0.0.9:10001")


def test_an_address_of_another_cluster_than_the_one_connected_is_refused() -> None:
    from hybridflow.runtime.ray_executor import _check_same_cluster

    _check_same_cluster("localhost:6379", "127.0.0.1:6379")  # the same cluster, spelled otherwise
    _check_same_cluster("auto", "127.0.0.1:6379")  # Ray's own forms are Ray's to resolve
    with pytest.raises(RuntimeError, match=r"'127\.0\.0\.1:43703'.*already connected.*127\.0\.0\.1:6379"):
        _check_same_cluster("127.0.0.1:43703", "127.0.0.1:6379")


CLI = "import sys; from hybridflow.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.mark.parametrize("executor", ["local", pytest.param("ray", marks=[pytest.mark.ray, pytest.mark.slow])])
def test_sigterm_stops_a_cli_run_like_ctrl_c(executor: str, rewards: Path, tmp_path: Path) -> None:
    if executor == "ray":
        pytest.importorskip("ray")
    marker = tmp_path / "scoring"
    env = {**os.environ, "HF_TEST_MARKER": str(marker), "OMP_NUM_THREADS": "1"}
    # sigterm_grace_s=0: at once, as Ctrl-C (the checkpointing stop: tests/reliability/test_preemption.py)
    words = [*QUICK, f"output_dir={tmp_path / 'run'}", f"data.reward={rewards}:marks_then_sleeps",
             f"executor.name={executor}", "checkpoint.sigterm_grace_s=0"]
    process = subprocess.Popen([sys.executable, "-c", CLI, "train", *words], env=env,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), f"the run never reached its first reward: {process.communicate()[1]}"
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143, err
    assert "Traceback" not in err and "hybridflow train: error: terminated (SIGTERM)" in err, err
