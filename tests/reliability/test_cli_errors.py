"""The CLI's one-line messages for failures buried in chains: a full disk, permissions, interrupts, and the
training step a worker failure happened in."""

from __future__ import annotations

import errno
import os

import pytest

from hybridflow.cli.errors import BAD_INPUT, INTERRUPTED, RUN_FAILED, describe
from hybridflow.runtime.errors import StepTracker, WorkerFailedError


def _chained(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as err:
            raise outer from err
    except BaseException as err:
        return err


def test_a_full_disk_under_a_torch_error_is_named() -> None:
    torch_error = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 320 vs 256 "
                               "PytorchStreamWriter failed writing file data/0: file write failed")
    code, line = describe(_chained(RuntimeError("saving role 'actor' failed"), torch_error))
    assert code == RUN_FAILED and line.startswith("no space left on device") and "\n" not in line
    code, line = describe(OSError(errno.ENOSPC, "No space left on device", "/runs/x/metrics.jsonl"))
    assert code == RUN_FAILED and "no space left on device (/runs/x/metrics.jsonl)" in line


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_torch_saving_to_a_full_disk_says_so() -> None:
    import torch

    with pytest.raises(RuntimeError) as failed:
        torch.save({"weights": torch.ones(1000)}, "/dev/full")  # every write fails with ENOSPC
    code, line = describe(failed.value)
    assert code == RUN_FAILED and line.startswith("no space left on device")


def test_a_permission_error_names_the_file() -> None:
    inner = PermissionError(errno.EACCES, "Permission denied", "/runs/x/checkpoints")
    code, line = describe(_chained(OSError("could not save"), inner))
    assert code == RUN_FAILED and line.startswith("permission denied (/runs/x/checkpoints)")


def test_bad_input_and_interrupts() -> None:
    assert describe(KeyError("unknown config key 'x'")) == (BAD_INPUT, "unknown config key 'x'")
    assert describe(KeyboardInterrupt())[0] == INTERRUPTED
    code, line = describe(ZeroDivisionError("odd"))
    assert code == RUN_FAILED and "--debug" in line


def test_a_worker_failure_names_the_step_it_happened_in() -> None:
    pattern = r"during step 7 \(last completed step: 6\)"
    with pytest.raises(WorkerFailedError, match=pattern) as failed, StepTracker() as running:
        running.step = 7
        raise WorkerFailedError(role="actor", rank=1, group=0, node="actor_generate", cause="no heartbeat",
                                where="host h (Ray node abc, pid 42)")
    assert failed.value.step == 7 and "host h (Ray node abc, pid 42)" in str(failed.value)
    assert describe(failed.value)[0] == RUN_FAILED


def test_every_bad_config_key_is_printed_not_only_the_first() -> None:
    from hybridflow.train.aliases import ConfigKeyError

    code, text = describe(ConfigKeyError(["unknown config key 'stepz'", "unknown config key 'data.pth'"]))
    assert code == BAD_INPUT and text.splitlines() == ["2 config keys need a fix:", "  - unknown config key 'stepz'",
                                                       "  - unknown config key 'data.pth'"]
    assert describe(ConfigKeyError(["one"])) == (BAD_INPUT, "one")
