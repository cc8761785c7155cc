"""SIGTERM during a run: outside the step loop it raises Terminated at once; inside it asks the run to stop after
the step in flight, which is abandoned once the grace runs out or a second SIGTERM comes; a torchrun serving rank
only notes it; a handler the application installed is kept, Ray's is replaced for the run and put back."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hybridflow.graph import Op
from hybridflow.train.signals import Terminated, is_ray_handler, sigterm_deferred, stop_on_sigterm


@pytest.fixture(autouse=True)
def default_sigterm() -> Iterator[None]:
    """Each test starts from SIGTERM's default action: an earlier test in the same process that ran ``ray.init``
    leaves Ray's handler (``sys.exit``) installed, which these tests would otherwise see as the one to put back."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, previous)


def _sigterm_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler runs at the next bytecode; reaching the end means it did not raise


def test_outside_the_step_loop_sigterm_raises_terminated_and_is_default_again_after() -> None:
    with pytest.raises(Terminated), stop_on_sigterm(20.0):
        _sigterm_self()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert issubclass(Terminated, KeyboardInterrupt)  # every `except KeyboardInterrupt` clean-up runs


def test_in_a_step_sigterm_asks_to_stop_and_the_step_goes_on() -> None:
    with stop_on_sigterm(20.0) as stop, stop.deferred(), stop.abandonable():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.3)  # not cut short
        finished = True
    assert finished and stop.requested and not stop.abandoned and not stop.grace_over


def test_a_step_still_running_when_the_grace_runs_out_is_abandoned_even_in_a_blocking_wait() -> None:
    never = threading.Event()
    with stop_on_sigterm(0.5) as stop, stop.deferred():
        with pytest.raises(Terminated), stop.abandonable():
            os.kill(os.getpid(), signal.SIGTERM)
            started = time.monotonic()
            never.wait(30)  # a lock acquire, as when the loop waits on a worker's future
        waited = time.monotonic() - started
    assert stop.abandoned and stop.grace_over
    assert 0.4 < waited < 5, waited


def test_a_second_sigterm_abandons_the_step_at_once() -> None:
    with stop_on_sigterm(60.0) as stop, stop.deferred(), pytest.raises(Terminated), stop.abandonable():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        _sigterm_self()
    assert stop.abandoned and not stop.grace_over


def test_between_steps_and_while_checkpointing_sigterm_and_the_grace_only_ask_to_stop() -> None:
    with stop_on_sigterm(0.2) as stop, stop.deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # the grace runs out here: nothing is cut short outside a step
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        assert stop.requested and stop.grace_over and not stop.abandoned
        with pytest.raises(Terminated), stop.abandonable():  # a step begun after the grace is over is not run
            pytest.fail("the step ran")


def test_a_grace_of_zero_stops_at_once_without_a_checkpoint() -> None:
    with stop_on_sigterm(0.0) as stop, stop.deferred(), pytest.raises(Terminated):
        _sigterm_self()
    assert not stop.requested


def test_rays_handler_is_replaced_for_the_run_and_put_back() -> None:
    def sigterm_handler(signum: int, frame: Any) -> None:  # what ray.init installs in a driver: sys.exit(signum)
        raise SystemExit(signum)

    sigterm_handler.__module__ = "ray._private.worker"
    assert is_ray_handler(sigterm_handler)
    signal.signal(signal.SIGTERM, sigterm_handler)
    with stop_on_sigterm(20.0) as stop, stop.deferred(), stop.abandonable():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
    assert stop.requested
    assert signal.getsignal(signal.SIGTERM) is sigterm_handler


def test_the_real_ray_handler_is_recognised() -> None:
    ray = pytest.importorskip("ray")
    source = Path(ray._private.worker.__file__).read_text()
    assert "def sigterm_handler(signum, frame):\n        sys.exit(signum)" in source  # what is_ray_handler matches


def test_a_serving_rank_notes_sigterm_and_keeps_serving() -> None:
    with sigterm_deferred() as received:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not received and time.monotonic() < deadline:
            time.sleep(0.01)
    assert received == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_an_installed_handler_is_left_alone() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with stop_on_sigterm(20.0) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
        assert seen == [signal.SIGTERM] and not stop.requested
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_classic_api_trains_under_trains_sigterm_handler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``SingleController.fit`` runs ``train``, which installs the handler: a SIGTERM while it prepares raises
    Terminated to fit's caller (the step loop's checkpoint: tests/reliability/test_preemption.py)."""
    from hybridflow import DataParallelConfig, SingleController
    from hybridflow.train import loop

    def sigterm_self(*args: Any, **kwargs: Any) -> None:
        _sigterm_self()

    prepared = SimpleNamespace(scorer=SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(loop, "prepare_run", lambda *args, **kwargs: prepared)
    monkeypatch.setattr(loop, "_train", sigterm_self)
    config = DataParallelConfig(actor_model_device_mesh=[0], reference_model_device_mesh=[0],
                                reward_model_device_mesh=[0], data_parallel_size=1, fsdp_sharding_strategy="NO_SHARD")
    controller = SingleController(config=config, actor_model="tiny-qwen2", reward_model="tiny-qwen2",
                                  reference_model="tiny-qwen2", settings={"output_dir": str(tmp_path / "run")})
    with pytest.raises(Terminated):
        controller.fit(steps=1)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.parametrize("update_started", [False, True])
def test_an_abandoned_step_is_intact_only_if_no_update_started(update_started: bool) -> None:
    """``Controller.abandon_step`` cancels the step's calls not yet started; what a checkpoint holds is the last
    finished step's only while no update (or stateful compute node) has started."""
    from hybridflow.runtime.controller import Controller

    release = threading.Event()
    queue = ThreadPoolExecutor(1)
    try:
        generate = queue.submit(release.wait, 10)  # the node each queue is running: it finishes
        update = queue.submit(lambda: None)
        calls = [(SimpleNamespace(name="generate", op=Op.GENERATE), generate),
                 (SimpleNamespace(name="update", op=Op.UPDATE), update)]
        if update_started:
            release.set()
            update.result(timeout=10)
        controller: Any = SimpleNamespace(_step_calls=calls, _overlap=None, node_states={})
        intact = Controller.abandon_step(controller)
        assert intact is not update_started
        assert update.cancelled() is not update_started and not generate.cancelled()
    finally:
        release.set()
        queue.shutdown()
