"""SIGTERM stops a run as Ctrl-C does: raised as Terminated in the main thread (the CLI, the classic API, torchrun's
rank 0), only noted on a torchrun serving rank until rank 0 says leave; a handler someone installed is kept."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hybridflow.train.signals import Terminated, sigterm_as_interrupt, sigterm_deferred


@pytest.fixture(autouse=True)
def default_sigterm() -> Iterator[None]:
    """Each test starts from SIGTERM's default action: an earlier test in the same process that ran ``ray.init``
    leaves Ray's handler (``sys.exit``) installed, which these tests would keep as "someone's handler"."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, previous)


def _sigterm_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler runs at the next bytecode; reaching the end means it did not raise


def test_sigterm_raises_terminated_inside_and_is_default_again_after() -> None:
    with pytest.raises(Terminated), sigterm_as_interrupt():
        _sigterm_self()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert issubclass(Terminated, KeyboardInterrupt)  # every `except KeyboardInterrupt` clean-up runs


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
        with sigterm_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_classic_api_trains_under_the_sigterm_handler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``SingleController.fit`` runs ``train`` with SIGTERM raised as Terminated (``train``'s clean-up then runs as
    for Ctrl-C; the CLI tests in tests/reliability/test_deadlines.py check that clean-up end to end)."""
    from hybridflow import DataParallelConfig, SingleController
    from hybridflow.train import loop

    def train(*args: Any, **kwargs: Any) -> None:
        _sigterm_self()

    monkeypatch.setattr(loop, "train", train)
    config = DataParallelConfig(actor_model_device_mesh=[0], reference_model_device_mesh=[0],
                                reward_model_device_mesh=[0], data_parallel_size=1, fsdp_sharding_strategy="NO_SHARD")
    controller = SingleController(config=config, actor_model="tiny-qwen2", reward_model="tiny-qwen2",
                                  reference_model="tiny-qwen2", settings={"output_dir": str(tmp_path / "run")})
    with pytest.raises(Terminated):
        controller.fit(steps=1)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
