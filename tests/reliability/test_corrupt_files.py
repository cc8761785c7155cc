"""Corrupt and truncated files a run reads back: each is named with the fix, resume falls back to the newest
intact checkpoint (with a warning naming the broken file), and `hybridflow report` skips the torn last line
a crash leaves while refusing garbage by file and line."""

from __future__ import annotations

import json
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest

from hybridflow.cli import main
from hybridflow.train.file_checks import checkpoint_problem, json_problem, safetensors_problem, torch_file_problem
from reliability.test_bad_inputs import _one_error_line
from reliability.test_rundir import QUICK

STEP_1, STEP_2 = "checkpoints/step_000001", "checkpoints/step_000002"
STATE = "roles/actor/state.pt"
WEIGHTS = "hf/model.safetensors"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-step run with checkpoints at steps 1 and 2."""
    root = tmp_path_factory.mktemp("checkpointed")
    assert main(["train", f"output_dir={root / 'run'}", *QUICK, "steps=2", "checkpoint.every=1"]) == 0
    return root / "run"


def _copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _scramble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-200:] = b"\x00" * 200  # the zip's central directory, or the safetensors' last tensor bytes kept in size
    path.write_bytes(bytes(data))


BREAK = {
    "truncated state.pt": (STATE, _truncate, r"state\.pt is truncated or corrupt"),
    "zeroed end of state.pt": (STATE, _scramble, r"state\.pt is truncated or corrupt"),
    "empty state.pt": (STATE, lambda p: p.write_bytes(b""), r"state\.pt is truncated or corrupt"),
    "trainer.json not JSON": ("trainer.json", lambda p: p.write_text('{"step": 2, "se'), r"trainer\.json is not JSON"),
    "trainer.json without a step": ("trainer.json", lambda p: p.write_text('{"seed": 0}'),
                                    r"trainer\.json has no integer 'step'"),
    "truncated safetensors": (WEIGHTS, _truncate, r"model\.safetensors is truncated"),
    "safetensors header garbage": (WEIGHTS, lambda p: p.write_bytes(b"\xff" * 64),
                                   r"model\.safetensors is truncated or corrupt \(its header claims"),
}


@pytest.mark.parametrize("broken", list(BREAK), ids=list(BREAK))
def test_resume_falls_back_to_the_newest_intact_checkpoint(broken: str, finished_run: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(finished_run, tmp_path)
    name, damage, pattern = BREAK[broken]
    damage(run / STEP_2 / name)
    assert main(["train", f"output_dir={run}", *QUICK, "steps=3", "--resume"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    warning = next(line for line in err.splitlines() if "skipping a broken checkpoint" in line)
    assert f"step_000002/{name}" in warning, warning
    assert re.search(pattern, warning), warning
    assert f"resuming from {run / STEP_1}, the newest intact checkpoint" in err
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2], "the resumed run must redo step 2 from the step-1 checkpoint"


def test_no_intact_checkpoint_is_an_error_naming_the_broken_file(finished_run: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(finished_run, tmp_path)
    for step in (STEP_1, STEP_2):
        _truncate(run / step / STATE)
    code = main(["train", f"output_dir={run}", *QUICK, "steps=3", "--resume"])
    _one_error_line(capsys.readouterr().err, code, 2,
                    r"no complete checkpoint to resume from \(2 broken: .*step_000002/roles/actor/state\.pt is "
                    r"truncated")


def test_resume_from_a_broken_checkpoint_names_the_file_and_an_intact_one(finished_run: Path, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(finished_run, tmp_path)
    _truncate(run / STEP_2 / STATE)
    code = main(["train", f"output_dir={tmp_path / 'other'}", *QUICK, "steps=3", "--resume-from",
                 str(run / STEP_2)])
    _one_error_line(capsys.readouterr().err, code, 2,
                    r"step_000002/roles/actor/state\.pt is truncated or corrupt.*use --resume-from .*step_000001")


def test_a_fresh_run_names_a_directory_with_broken_checkpoints(finished_run: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(finished_run, tmp_path)
    (run / STEP_2 / "trainer.json").write_text("garbage")
    code = main(["train", f"output_dir={run}", *QUICK, "steps=2"])
    _one_error_line(capsys.readouterr().err, code, 2, r"already holds a previous run, checkpoints up to step 1")


def test_loading_a_corrupt_state_names_the_file(finished_run: Path, tmp_path: Path) -> None:
    from hybridflow.train.checkpoint_state import checkpoint_state

    run = _copy(finished_run, tmp_path)
    _truncate(run / STEP_2 / STATE)
    with pytest.raises(ValueError, match=r"step_000002/roles/actor/state\.pt cannot be loaded .*truncated or corrupt"):
        checkpoint_state(run / STEP_2 / "roles" / "actor")


def test_the_torch_backend_names_a_corrupt_state_file(finished_run: Path, tmp_path: Path) -> None:
    import torch
    from hybridflow.backends.torch import TorchRoleEngine

    run = _copy(finished_run, tmp_path)
    _truncate(run / STEP_2 / STATE)
    engine = object.__new__(TorchRoleEngine)
    engine.context = type("Context", (), {"device": torch.device("cpu")})()  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"state\.pt cannot be loaded .*resume from an older checkpoint"):
        engine.load_checkpoint(str(run / STEP_2 / "roles" / "actor"))


def test_a_model_dir_with_truncated_weights_is_named(finished_run: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    model = Path(shutil.copytree(finished_run / "final", tmp_path / "model"))
    _truncate(model / "model.safetensors", 0.9)
    code = main(["train", f"output_dir={tmp_path / 'run'}", *QUICK, "steps=1", f"model.path={model}"])
    _one_error_line(capsys.readouterr().err, code, 2,
                    r"'model\.path': .*model/model\.safetensors is truncated \(\d+ bytes; its tensors need \d+\); "
                    r"copy the model directory again")


def test_intact_files_pass_every_check(finished_run: Path) -> None:
    assert checkpoint_problem(finished_run / STEP_2) is None
    assert safetensors_problem(finished_run / "final" / "model.safetensors") is None
    assert torch_file_problem(finished_run / STEP_2 / STATE) is None
    assert json_problem(finished_run / STEP_2 / "trainer.json") is None


def test_file_checks_tell_what_is_wrong(tmp_path: Path) -> None:
    (tmp_path / "list.json").write_text("[1]")
    assert json_problem(tmp_path / "list.json") == "holds a list, not a JSON mapping"
    assert "cannot be read" in str(json_problem(tmp_path / "missing.json"))
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as archive:
        archive.writestr("readme.txt", "not a checkpoint")
    assert torch_file_problem(tmp_path / "other.zip") == "is not a torch.save archive (no data.pkl in it)"
    (tmp_path / "short.safetensors").write_bytes(b"abc")
    assert "shorter than a safetensors header" in str(safetensors_problem(tmp_path / "short.safetensors"))
    header = b'not json'
    (tmp_path / "bad.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    assert "header is not JSON" in str(safetensors_problem(tmp_path / "bad.safetensors"))


def _report(run: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["report", str(run), "--plots", str(run / "plots"), "--html", str(run / "report.html")])
    return code, capsys.readouterr().err


def test_report_skips_the_torn_last_line_with_a_warning(finished_run: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(finished_run, tmp_path)
    with (run / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 2, "reward/me')  # a crash mid-write
    code, err = _report(run, capsys)
    assert code == 0, err
    assert "metrics.jsonl line 3 is torn (an interrupted write); skipped it" in err and "Traceback" not in err


REPORT_GARBAGE = {
    "binary": (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", r"metrics\.jsonl is not a metrics\.jsonl \(binary data"),
    "a broken middle line": (b'{"step": 0}\nnot json\n{"step": 1}\n', r"metrics\.jsonl line 2 is not JSON"),
    "a list line": (b'{"step": 0}\n[1, 2]\n', r"metrics\.jsonl line 2 is a list, not a JSON object"),
    "text": (b"hello world\n", r"metrics\.jsonl line 1 is not JSON"),
}


@pytest.mark.parametrize("kind", list(REPORT_GARBAGE), ids=list(REPORT_GARBAGE))
def test_report_refuses_garbage_naming_the_file(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, pattern = REPORT_GARBAGE[kind]
    (tmp_path / "metrics.jsonl").write_bytes(data)
    code, err = _report(tmp_path, capsys)
    _one_error_line(err, code, 2, pattern)


# ---- FSDP (torch DCP) and DeepSpeed checkpoints: every file named, resume falls back ------------------------
def _sharded_run(tmp_path: Path) -> Path:
    """A run directory with checkpoints at steps 1 and 2, each holding an fsdp actor (DCP shards written without
    a process group, as one rank) and a deepspeed critic (ZeRO files under its tag), written by save_checkpoint."""
    import torch
    from hybridflow.backends.fsdp import checkpoint as dcp_checkpoint

    from hybridflow.runtime.batch import Batch
    from hybridflow.runtime.rollout_state import RolloutState, write_state
    from hybridflow.train.checkpoint import save_checkpoint

    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()

    def write_roles(directory: str) -> None:
        dcp_checkpoint.save(f"{directory}/actor", model, optimizer)
        tag = Path(directory) / "critic" / "hybridflow"
        tag.mkdir(parents=True)
        torch.save({"module": model.state_dict()}, tag / "mp_rank_00_model_states.pt")
        torch.save({"optimizer_state_dict": optimizer.state_dict()}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        write_state(directory, RolloutState(k=1, segment_tokens=None, weights_version=1, segments=0, pads={},
                                            ready={1: Batch({"responses": torch.ones(4, 3, dtype=torch.long)})},
                                            pending={}, flight=[]))

    for step in (1, 2):
        save_checkpoint(tmp_path / "run", step, write_roles, {"seed": 0})
    return tmp_path / "run"


SHARDED = {
    "truncated DCP shard": ("roles/actor/__0_0.distcp", r"__0_0\.distcp is truncated or was rewritten \(\d+ bytes; "
                                                         r"the checkpoint wrote \d+\)"),
    "truncated DCP metadata": ("roles/actor/.metadata", r"\.metadata is truncated or corrupt \(not a whole pickle"),
    "truncated ZeRO optimizer shard": ("roles/critic/hybridflow/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                       r"optim_states\.pt is truncated or corrupt"),
    "truncated DeepSpeed model states": ("roles/critic/hybridflow/mp_rank_00_model_states.pt",
                                         r"model_states\.pt is truncated or corrupt"),
    "truncated rollout state": ("roles/rollout_state.bin", r"rollout_state\.bin is truncated or corrupt"),
}


@pytest.mark.parametrize("broken", list(SHARDED), ids=list(SHARDED))
def test_a_broken_fsdp_or_deepspeed_file_is_named_and_skipped(broken: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from hybridflow.train.rundir import find_checkpoint

    run = _sharded_run(tmp_path)
    name, pattern = SHARDED[broken]
    _truncate(run / STEP_2 / name)
    problem = checkpoint_problem(run / STEP_2)
    assert problem is not None and re.search(pattern, problem), problem
    assert checkpoint_problem(run / STEP_1) is None
    assert find_checkpoint(run, resume=True, resume_from=None) == run / STEP_1
    err = capsys.readouterr().err
    assert f"skipping a broken checkpoint: {run / STEP_2 / name}" in err and "the newest intact checkpoint" in err


def test_a_missing_shard_is_named(tmp_path: Path) -> None:
    run = _sharded_run(tmp_path)
    (run / STEP_2 / "roles/actor/__0_0.distcp").unlink()
    assert checkpoint_problem(run / STEP_2) == f"{run / STEP_2 / 'roles/actor/__0_0.distcp'} is missing (the " \
                                               "checkpoint wrote it)"


def test_loading_a_broken_fsdp_checkpoint_names_it_and_the_fix(tmp_path: Path) -> None:
    import torch
    from hybridflow.backends.fsdp import checkpoint as dcp_checkpoint

    from hybridflow.train.checkpoint_state import checkpoint_state

    run = _sharded_run(tmp_path)
    actor = run / STEP_2 / "roles" / "actor"
    (actor / "__0_0.distcp").write_bytes(b"\x00" * (actor / "__0_0.distcp").stat().st_size)  # same size: garbage
    model = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match=r"the fsdp checkpoint .*step_000002/roles/actor cannot be loaded \(rank 0: "
                                         r"\w+.*\); it is truncated or corrupt: resume from an older checkpoint"):
        dcp_checkpoint.load(str(actor), model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match=r"the fsdp checkpoint .*roles/actor cannot be loaded .*use an older"):
        checkpoint_state(actor, trust=True)  # trusted: the corruption is what is checked here
    _truncate(actor / ".metadata")
    with pytest.raises(ValueError, match=r"\.metadata is truncated or corrupt .*use an older checkpoint"):
        checkpoint_state(actor, trust=True)


def test_loading_a_broken_deepspeed_checkpoint_names_the_file(tmp_path: Path) -> None:
    from hybridflow.backends.deepspeed.engine import DeepSpeedRoleEngine

    run = _sharded_run(tmp_path)
    critic = run / STEP_2 / "roles" / "critic"
    _truncate(critic / "hybridflow" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    from hybridflow.train.checkpoint_state import checkpoint_state

    assert set(checkpoint_state(run / STEP_2 / "roles" / "actor", trust=True)) == {"weight", "bias"}  # another role's

    class Failing:  # DeepSpeed's engine, failing as its torch.load of a truncated shard does
        def load_checkpoint(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory")

    engine = object.__new__(DeepSpeedRoleEngine)
    engine.engine = Failing()  # type: ignore[assignment]
    engine.spec = type("Spec", (), {"lora": None})()  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"zero_pp_rank_0_mp_rank_00_optim_states\.pt \(in the deepspeed checkpoint "
                                         r".*roles/critic\) cannot be loaded \(RuntimeError: PytorchStreamReader.*\); "
                                         r"it is truncated or corrupt: resume from an older checkpoint"):
        engine.load_checkpoint(str(critic))


def test_a_garbled_rollout_state_is_named_with_the_fix(tmp_path: Path) -> None:
    from hybridflow.runtime.rollout_state import ROLLOUT_STATE, read_state

    run = _sharded_run(tmp_path)
    roles = run / STEP_2 / "roles"
    assert read_state(roles) is not None
    (roles / ROLLOUT_STATE).write_bytes(b"\x10" + b"\x00" * 7 + b'{"__t": "list", "v": [1]}' + b"\x00" * 3)
    with pytest.raises(ValueError, match=r"rollout_state\.bin is truncated or corrupt \(.*\); resume from an older "
                                         r"checkpoint, or delete the file"):
        read_state(roles)


def test_a_manifest_records_every_file_of_a_checkpoint(finished_run: Path) -> None:
    manifest = json.loads((finished_run / STEP_2 / "files.json").read_text())["files"]
    assert manifest[STATE] == (finished_run / STEP_2 / STATE).stat().st_size and "trainer.json" in manifest


# ---- the planner's readers of a run's metrics.jsonl: a torn last line skipped, garbage refused -----------------
ROWS = [{"step": s, "time/step": 1.0 + s, "time/actor_generate": 0.5, "response_length/mean": 10.0 + s,
         "response_length/max": 20.0, "agent/turns_mean": 2.0, "agent/turns_max": 3.0,
         "agent/tool_latency_p50_s": 0.1} for s in range(3)]


def _readers() -> dict[str, Any]:
    from hybridflow.planner.agents import AgentWorkload
    from hybridflow.planner.lengths import LengthDistribution
    from hybridflow.planner.measured import measured_node_times

    return {"lengths": LengthDistribution.from_metrics, "agent": AgentWorkload.from_metrics,
            "node times": measured_node_times}


@pytest.mark.parametrize("reader", ["lengths", "agent", "node times"])
def test_planner_readers_skip_a_torn_last_line(reader: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "metrics.jsonl"
    whole = "".join(json.dumps(row) + "\n" for row in ROWS)
    path.write_text(whole)
    expected = _readers()[reader](path)
    path.write_text(whole + '{"step": 3, "response_len')  # a crash mid-write
    assert _readers()[reader](path) == expected
    assert "metrics.jsonl line 4 is torn (an interrupted write); skipped it" in capsys.readouterr().err


PLANNER_GARBAGE = {
    "binary": (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", r"metrics\.jsonl is not a metrics\.jsonl \(binary data at byte"),
    "a broken middle line": (b'{"step": 0}\nnot json\n{"step": 1}\n', r"metrics\.jsonl line 2 is not JSON"),
    "a list line": (b'{"step": 0}\n[1, 2]\n', r"metrics\.jsonl line 2 is a list, not a JSON object"),
    "a string metric": (b'{"step": 0, "time/step": "fast", "response_length/mean": "long", "agent/turns_mean": "x"}\n'
                        * 2, r"metrics\.jsonl line \d: '[\w/]+' is '\w+', not a finite number"),
}


@pytest.mark.parametrize("kind", list(PLANNER_GARBAGE), ids=list(PLANNER_GARBAGE))
def test_planner_readers_refuse_garbage_naming_the_file_and_line(kind: str, tmp_path: Path) -> None:
    data, pattern = PLANNER_GARBAGE[kind]
    (tmp_path / "metrics.jsonl").write_bytes(data)
    for reader in _readers().values():
        with pytest.raises(ValueError, match=pattern):
            reader(tmp_path / "metrics.jsonl")


def test_plan_lengths_from_garbage_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "metrics.jsonl").write_bytes(b"\x00\x01garbage\xff")
    code = main(["plan", "--algorithm", "grpo", "--cluster", "4xA100-80G", "--model", "qwen2.5-1.5b",
                 "--lengths-from", str(tmp_path / "metrics.jsonl")])
    _one_error_line(capsys.readouterr().err, code, 2, r"metrics\.jsonl is not a metrics\.jsonl \(binary data")
