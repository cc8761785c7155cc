"""Bad inputs to ``hybridflow train``/``graph`` and the classic API: each is refused with one line that names
the problem (exit 2 for bad input, 1 for a run that failed), never a traceback, and almost all before any
model is trained."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hybridflow.cli import main

QUICK = ["model.sft_steps=0", "data.batch_size=4", "data.num_examples=16", "algorithm.options.n=2",
         "algorithm.options.max_new_tokens=4", "logging.progress=false", "logging.plot=false", "logging.trackers=[]",
         "steps=1"]
REWARDS = '''
import math
def as_string(response, ground_truth): return "0.5"
def nan(response, ground_truth): return math.nan
def inf(response, ground_truth): return -math.inf
def raises(response, ground_truth): raise ZeroDivisionError("boom")
def none(response, ground_truth): return None
def as_list(response, ground_truth): return [1.0]
def no_args(): return 1.0
def one_arg(response): return 1.0
def needs_more(response, ground_truth, tokenizer): return 1.0
def nan_on_wrong(response, ground_truth): return 1.0 if response == ground_truth else math.nan
def string_on_wrong(response, ground_truth): return 1.0 if response == ground_truth else "0"
not_callable = 3
'''
GRAPHS = '''
def not_a_graph(**options): return 42
def raises(**options): raise RuntimeError("user graph failed")
'''
FILES = {
    "empty.jsonl": "",
    "broken.jsonl": '{"prompt": "a", "ground_truth": "b"}\n{"prompt": "c", "ground_truth": "d"}\n'
                    '{"prompt": "e", "gro\n',
    "noprompt.jsonl": '{"question": "a", "ground_truth": "b"}\n',
    "intprompt.jsonl": '{"prompt": 5, "ground_truth": "b"}\n',
    "notobj.jsonl": "[1, 2]\n",
    "long.jsonl": '{"prompt": "' + "x" * 300 + '", "ground_truth": "b"}\n',
    "unknown_chars.jsonl": '{"prompt": "h\u00e9llo \u2603", "ground_truth": "b"}\n',
    "data.txt": "hello",
    "bad.parquet": "PAR1 not really",
    "rewards.py": REWARDS,
    "graphs.py": GRAPHS,
    "syntax.py": "def f(:\n",
    "explodes.py": "raise RuntimeError('import-time failure')\n",
    "bad.yaml": "steps: [1,\n",
    "tabs.yaml": "model:\n\tname: tiny-qwen2\n",
    "list.yaml": "- steps\n- 3\n",
    "unknown.yaml": "stepz: 3\n",
    "python_tag.yaml": "steps: !!python/object/apply:os.system ['echo pwned']\n",
    "wrong_type.yaml": "seed: three\n",
    "nested_wrong.yaml": "model: tiny-qwen2\n",
    "plan_not_json.json": "not json",
    "plan_empty.json": "{}",
    "not_a_model/README": "no config.json here",
    "a_file": "x",
    "foreign/thesis.tex": "years of work",
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bad_inputs")
    for name, text in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "emptydir").mkdir()
    return root


# (id, arguments with {d} for the inputs folder, exit code, a regex the one error line must match)
TRAIN: list[tuple[str, str, int, str]] = [
    # config keys and values
    ("unknown key", "actor.learning_rate_x=1", 2, r"actor\.learning_rate_x"),
    ("unknown top key", "stepz=3", 2, r"unknown config key 'stepz'"),
    ("steps zero", "steps=0", 2, r"'steps'=0 must be >= 1"),
    ("steps a string", "steps=abc", 2, r"'steps'='abc' must be a int"),
    ("steps a float", "steps=1.5", 2, r"'steps'=1\.5 must be a int"),
    ("num_gpus zero", "placement.num_gpus=0", 2, r"'placement\.num_gpus'=0"),
    ("executor unknown", "executor.name=slurm", 2, r"'executor\.name'='slurm' must be one of"),
    ("placement unknown", "placement.mode=magic", 2, r"'placement\.mode'='magic'"),
    ("sft_steps negative", "model.sft_steps=-1", 2, r"'model\.sft_steps'=-1 must be >= 0"),
    ("sft_batch_size zero", "model.sft_batch_size=0", 2, r"model\.sft_batch_size"),
    ("sft_lr zero", "model.sft_lr=0", 2, r"model\.sft_lr"),
    ("sft_lr nan", "model.sft_lr=.nan", 2, r"model\.sft_lr"),
    ("model name unknown", "model.name=gpt-9", 2, r"model\.name.*not a built-in tiny model"),
    ("model path missing", "model.path={d}/no_model", 2, r"model\.path.*no such directory"),
    ("model path a file", "model.path={d}/a_file", 2, r"model\.path.*not an HF model directory"),
    ("model path no config", "model.path={d}/not_a_model", 2, r"no config\.json"),
    ("data batch zero", "data.batch_size=0", 2, r"data\.batch_size"),
    ("data examples zero", "data.num_examples=0", 2, r"data\.num_examples"),
    ("data task unknown", "data.task=unknown", 2, r"neither a built-in reward function"),
    ("actor micro zero", "optim.actor.micro_batch_size=0", 2, r"optim\.actor\.micro_batch_size'=0 must be >= 1"),
    ("critic micro negative", "optim.critic.micro_batch_size=-1", 2, r"optim\.critic\.micro_batch_size"),
    ("actor lr zero", "optim.actor.lr=0", 2, r"lr=0"),
    ("actor lr negative", "optim.actor.lr=-1", 2, r"lr=-1"),
    ("actor epochs zero", "optim.actor.epochs=0", 2, r"epochs"),
    ("actor mini batches zero", "optim.actor.mini_batches=0", 2, r"mini_batches"),
    ("actor grad clip zero", "optim.actor.grad_clip=0", 2, r"optim\.actor\.grad_clip"),
    ("actor betas short", "optim.actor.betas=[0.9]", 2, r"optim\.actor\.betas"),
    ("actor betas range", "optim.actor.betas=[1.5,0.9]", 2, r"optim\.actor\.betas"),
    ("actor weight decay", "optim.actor.weight_decay=-1", 2, r"optim\.actor\.weight_decay"),
    ("seed negative", "seed=-1", 2, r"'seed'=-1"),
    ("checkpoint_every negative", "checkpoint.every=-1", 2, r"checkpoint\.every"),
    ("keep_checkpoints negative", "checkpoint.keep=-1", 2, r"checkpoint\.keep"),
    ("reward cache negative", "data.reward_cache_size=-1", 2, r"data\.reward_cache_size"),
    ("role unknown", "roles.nope.backend=torch", 2, r"roles\.nope"),
    ("backend unknown", "roles.actor.backend=nonexistent", 2, r"nonexistent"),
    ("role micro zero", "roles.actor.micro_batch_size=0", 2, r"micro_batch_size'=0"),
    ("rollout unknown", "roles.actor.rollout=magic", 2, r"rollout'='magic'"),
    ("rollout option moved", "roles.actor.options.rollout=vllm", 2, r"moved"),
    ("role model missing", "roles.actor.model={d}/no_model", 2, r"roles\.actor\.model"),
    ("meshes without manual", "placement.meshes={{actor:[0]}}", 2,
     r"'placement\.meshes' is only read with placement\.mode=manual"),
    ("separate rollout without auto", "placement.separate_rollout=true", 2, r"separate_rollout"),
    ("placement and plan file", "placement.mode=auto placement.plan_file={d}/plan_empty.json", 2, r"conflict"),
    ("plan file missing", "placement.plan_file={d}/no_plan.json", 2, r"plan_file.*no such file"),
    ("plan file not json", "placement.plan_file={d}/plan_not_json.json", 2, r"plan_file.*not JSON"),
    ("plan file not a plan", "placement.plan_file={d}/plan_empty.json", 2, r"plan_file.*not a plan"),
    ("algorithm unknown", "algorithm=nope", 2, r"unknown algorithm 'nope'; valid names"),
    ("algorithm option unknown", "algorithm.options.bogus=1", 2, r"takes no option 'bogus'"),
    ("samples zero", "algorithm.options.n=0", 2, r"n=0 must be a positive integer"),
    ("temperature negative", "algorithm.options.temperature=-1", 2, r"actor_generate.*temperature=-1 must be > 0"),
    ("response length zero", "algorithm.options.max_new_tokens=0", 2, r"max_new_tokens"),
    ("kl coefficient negative", "algorithm.options.kl_coef=-1", 2, r"kl_coef \(node 'actor_update'\)=-1 must be >= 0"),
    ("clip ratio negative", "algorithm.options.clip_ratio=-0.2", 2, r"clip_ratio .*must be >= 0"),
    ("entropy coefficient nan", "algorithm.options.entropy_coef=.nan", 2, r"entropy_coef .*=nan must be a finite"),
    ("val fraction negative", "data.val_fraction=-0.1", 2, r"'data\.val_fraction'=-0\.1 must be in \[0, 1\)"),
    ("liveness heartbeat zero", "executor.liveness.heartbeat_timeout_s=0", 2,
     r"'executor\.liveness\.heartbeat_timeout_s'=0\.0 must be > 0"),
    ("liveness deadline negative", "executor.liveness.call_timeout_s=-5", 2,
     r"'executor\.liveness\.call_timeout_s'=-5\.0 must be > 0"),
    ("liveness heartbeat order", "executor.liveness.heartbeat_timeout_s=1 executor.liveness.heartbeat_interval_s=5",
     2, r"'executor\.liveness\.heartbeat_timeout_s'=1\.0 must be >= executor\.liveness\.heartbeat_interval_s=5\.0"),
    ("liveness unknown key", "executor.liveness.timeout=3", 2, r"liveness\.timeout"),
    ("tracker unknown", "logging.trackers=[nope]", 2, r"trackers"),
    ("override without equals", "steps", 2, r"dotted\.key=value"),
    ("section given a value", "model=3", 2, r"'model' must be a mapping"),
    ("value given a section", "steps.x=1", 2, r"not a section"),
    ("val fraction too big", "data.val_fraction=2", 2, r"val_fraction"),
    ("max prompt length zero", "data.max_prompt_length=0", 2, r"max_prompt_length"),
    # YAML files
    ("yaml syntax", "--config {d}/bad.yaml", 2, r"not valid YAML: line 2"),
    ("yaml tabs", "--config {d}/tabs.yaml", 2, r"not valid YAML"),
    ("yaml list root", "--config {d}/list.yaml", 2, r"must be a mapping"),
    ("yaml missing file", "--config {d}/none.yaml", 2, r"No such file"),
    ("yaml unknown key", "--config {d}/unknown.yaml", 2, r"unknown config key 'stepz'"),
    ("yaml python tag", "--config {d}/python_tag.yaml", 2, r"not valid YAML.*constructor"),
    ("yaml wrong type", "--config {d}/wrong_type.yaml", 2, r"'seed'='three' must be a int"),
    ("yaml section a string", "--config {d}/nested_wrong.yaml", 2, r"'model' is not a section"),
    # run directories and flags
    ("resume nothing", "--resume", 2, r"no complete checkpoint"),
    ("resume and overwrite", "--resume --overwrite", 2, r"contradict"),
    ("config change without resume", "--allow-config-change", 2, r"only applies when resuming"),
    ("resume from missing", "--resume-from {d}/no_checkpoint", 2, r"not a checkpoint"),
    ("resume twice", "--resume --resume-from {d}/no_checkpoint", 2, r"not both|not a checkpoint"),
    ("output dir a file", "output_dir={d}/a_file", 2, r"is a file"),
    ("output dir foreign", "output_dir={d}/foreign", 2, r"already holds files"),
    ("overwrite foreign", "output_dir={d}/foreign --overwrite", 2, r"does not write"),
    ("unknown flag", "--frobnicate", 2, r"unrecognized arguments"),
    # data files
    ("data empty", "data.path={d}/empty.jsonl data.reward=math", 2, r"empty\.jsonl has no rows"),
    ("data broken line", "data.path={d}/broken.jsonl data.reward=math", 2, r"broken\.jsonl line 3: not valid JSON"),
    ("data no prompt", "data.path={d}/noprompt.jsonl data.reward=math", 2, r"noprompt\.jsonl line 1: no 'prompt'"),
    ("data int prompt", "data.path={d}/intprompt.jsonl data.reward=math", 2, r"intprompt\.jsonl line 1"),
    ("data not objects", "data.path={d}/notobj.jsonl data.reward=math", 2, r"notobj\.jsonl line 1"),
    ("data wrong extension", "data.path={d}/data.txt data.reward=math", 2, r"\.jsonl or \.parquet"),
    ("data bad parquet", "data.path={d}/bad.parquet data.reward=math", 2, r"bad\.parquet"),
    ("data empty dir", "data.path={d}/emptydir data.reward=math", 2, r"emptydir is a directory"),
    ("data missing", "data.path={d}/none.jsonl data.reward=math", 2, r"data\.path.*no such file"),
    ("data without reward", "data.path={d}/broken.jsonl", 2, r"data\.reward"),
    ("prompt beyond context", "data.path={d}/long.jsonl data.reward=math data.batch_size=1", 2,
     r"longest prompt has 300 tokens.*context of 256 tokens.*data\.max_prompt_length=252"),
    ("prompt characters unknown", "data.path={d}/unknown_chars.jsonl data.reward=math data.batch_size=1", 2,
     r"maps to '<unk>': \['\u00e9', '\u2603'\]"),
    ("every prompt filtered", "data.path={d}/long.jsonl data.reward=math data.max_prompt_length=100", 2,
     r"'data\.max_prompt_length'=100 tokens is shorter than all 1 prompts"),
    # reward functions: refused when loaded...
    ("reward no args", "data.reward={d}/rewards.py:no_args", 2, r"no_args"),
    ("reward one arg", "data.reward={d}/rewards.py:one_arg", 2, r"one_arg"),
    ("reward extra arg", "data.reward={d}/rewards.py:needs_more", 2, r"tokenizer"),
    ("reward missing name", "data.reward={d}/rewards.py:missing", 2, r"has no attribute 'missing'"),
    ("reward missing file", "data.reward={d}/none.py:f", 2, r"no file"),
    ("reward syntax error", "data.reward={d}/syntax.py:f", 2, r"syntax error in .*syntax\.py, line 1"),
    ("reward missing module", "data.reward=no_such_module:f", 2, r"no_such_module"),
    ("reward not callable", "data.reward={d}/rewards.py:not_callable", 2, r"not a function"),
    ("reward unknown name", "data.reward=maths", 2, r"maths"),
    ("reward import raises", "data.reward={d}/explodes.py:f", 1, r"import-time failure"),
    # ... or by one probe call before the model loads (row 0, its ground truth as the response) ...
    ("reward a string", "data.reward={d}/rewards.py:as_string", 2, r"returned '0\.5', which is a str.*before training"),
    ("reward nan", "data.reward={d}/rewards.py:nan", 2, r"returned nan, which is not finite.*prompt"),
    ("reward inf", "data.reward={d}/rewards.py:inf", 2, r"returned -inf, which is not finite.*response"),
    ("reward raises", "data.reward={d}/rewards.py:raises", 2, r"raised ZeroDivisionError: boom on sample 0"),
    ("reward none", "data.reward={d}/rewards.py:none", 2, r"returned None"),
    ("reward list", "data.reward={d}/rewards.py:as_list", 2, r"returned \[1\.0\]"),
    # ... or, for values only some responses produce, at the step that scores them: named as rewards, not a loss
    ("reward nan on wrong answers", "data.reward={d}/rewards.py:nan_on_wrong", 1,
     r"returned nan, which is not finite, for sample \d+ \(prompt '.*', response '.*', ground truth"),
    ("reward string on wrong answers", "data.reward={d}/rewards.py:string_on_wrong", 1,
     r"which is a str, not a number"),
]

GRAPH: list[tuple[str, str, int, str]] = [
    ("graph unknown", "nope", 2, r"unknown algorithm 'nope'"),
    ("graph not a graph", "{d}/graphs.py:not_a_graph", 2, r"not a Graph"),
    ("graph raises", "{d}/graphs.py:raises", 1, r"user graph failed"),
    ("graph syntax", "{d}/syntax.py:f", 2, r"syntax error"),
    ("graph missing file", "{d}/none.py:f", 2, r"no file"),
    ("graph bad format", "grpo --format bogus", 2, r"invalid choice"),
]


def _one_error_line(err: str, code: int, expected: int, pattern: str) -> None:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    assert code == expected, f"exit {code}, expected {expected}: {lines[0]}"
    assert re.search(pattern, lines[0]), f"{pattern!r} not in {lines[0]!r}"


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors (usage line, exit 2)
        code = int(exit_.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("arguments", "expected", "pattern"), [case[1:] for case in TRAIN],
                         ids=[case[0] for case in TRAIN])
def test_train_refuses(arguments: str, expected: int, pattern: str, inputs: Path, tmp_path: Path,
                       capsys: pytest.CaptureFixture[str]) -> None:
    words = arguments.format(d=inputs).split()
    out = [] if any(word.startswith("output_dir=") for word in words) else [f"output_dir={tmp_path / 'run'}"]
    code, err = _run(["train", *QUICK, *out, *words], capsys)
    _one_error_line(err, code, expected, pattern)
    if expected == 2 and not arguments.startswith("data.path") and "output_dir" not in arguments:
        assert not (tmp_path / "run" / "config.json").exists(), "config.json written by a run that failed validation"


@pytest.mark.parametrize(("arguments", "expected", "pattern"), [case[1:] for case in GRAPH],
                         ids=[case[0] for case in GRAPH])
def test_graph_refuses(arguments: str, expected: int, pattern: str, inputs: Path,
                       capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(["graph", *arguments.format(d=inputs).split()], capsys)
    _one_error_line(err, code, expected, pattern)


def test_debug_shows_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="steps"):
        main(["train", "steps=0", "--debug"])


def _dp(**fields: Any) -> Any:
    from hybridflow.classic import DataParallelConfig

    return DataParallelConfig(**fields)


def _controller(**arguments: Any) -> Any:
    from hybridflow.classic import SingleController

    return SingleController(**{"config": _dp(actor_model_device_mesh=[0, 1]), "actor_model": "tiny-qwen2",
                               **arguments})


def _set(field: str, value: Any) -> Callable[[], Any]:
    def change() -> None:
        setattr(_dp(actor_model_device_mesh=[0, 1]), field, value)
    return change


CLASSIC: list[tuple[str, Callable[[], Any], str]] = [
    ("gpu id huge", lambda: _dp(actor_model_device_mesh=[10**9]), r"implies a cluster of more than"),
    ("gpu id beyond cluster", lambda: _dp(actor_model_device_mesh=[8], cluster="8xA100-80G"), r"out of range"),
    ("gpu id negative", lambda: _dp(actor_model_device_mesh=[-1]), r"non-negative"),
    ("gpu id a string", lambda: _dp(actor_model_device_mesh=["0"]), r"non-negative integers"),
    ("gpu id a bool", lambda: _dp(actor_model_device_mesh=[True]), r"non-negative integers"),
    ("mesh empty", lambda: _dp(actor_model_device_mesh=[]), r"non-empty list"),
    ("mesh duplicate", lambda: _dp(actor_model_device_mesh=[0, 0]), r"twice"),
    ("mesh not a list", lambda: _dp(actor_model_device_mesh=3), r"non-empty list"),
    ("actor mesh none", lambda: _dp(actor_model_device_mesh=None), r"actor needs a device mesh"),
    ("meshes overlap", lambda: _dp(actor_model_device_mesh=[0, 1], critic_model_device_mesh=[1, 2]),
     r"partially overlaps"),
    ("dp not dividing", lambda: _dp(actor_model_device_mesh=[0, 1, 2], data_parallel_size=2), r"does not divide"),
    ("dp zero", lambda: _dp(data_parallel_size=0), r"positive integer"),
    ("strategy unknown", lambda: _dp(fsdp_sharding_strategy="ZERO9"), r"unknown strategy"),
    ("micro batch zero", lambda: _dp(actor_model_micro_batch_size=0), r"positive integer"),
    ("cache flag not bool", lambda: _dp(enable_reward_cache="yes"), r"True or False"),
    ("cluster not a string", lambda: _dp(cluster=8), r"cluster spec"),
    ("unknown field set", _set("actor_mesh", [0]), r"unknown parameter"),
    ("bad field set", _set("critic_model_device_mesh", [1, 5]), r"partially overlaps"),
    ("model path missing", lambda: _controller(actor_model="/no/such/model"), r"actor_model='/no/such/model'"),
    ("model name unknown", lambda: _controller(actor_model="gpt-9"), r"neither a local HF model"),
    ("critic without mesh", lambda: _controller(critic_model="tiny-qwen2"), r"critic_model_device_mesh is not"),
    ("mesh without model", lambda: _controller(config=_dp(actor_model_device_mesh=[0], critic_model_device_mesh=[1])),
     r"critic_model is missing"),
    ("settings unknown key", lambda: _controller(settings={"stepz": 3}), r"stepz"),
    ("settings bad value", lambda: _controller(settings={"steps": 0}), r"'steps'=0"),
    ("load a directory not saved", lambda: _controller().load("/"), r"not written by SingleController\.save"),
    ("load a path-escaping name", lambda: _load_saved({"checkpoint": "../../../victim"}), r"does not describe"),
    ("load a name of another type", lambda: _load_saved({"checkpoint": 3}), r"does not describe"),
]


def _load_saved(saved: dict[str, Any]) -> None:
    import json
    import tempfile

    folder = Path(tempfile.mkdtemp())
    (folder / "checkpoint").mkdir()
    (folder / "saved.json").write_text(json.dumps(saved))
    _controller().load(folder)


@pytest.mark.parametrize(("call", "pattern"), [case[1:] for case in CLASSIC], ids=[case[0] for case in CLASSIC])
def test_classic_api_refuses(call: Callable[[], Any], pattern: str) -> None:
    with pytest.raises((ValueError, KeyError, TypeError, FileNotFoundError)) as refused:
        call()
    assert re.search(pattern, str(refused.value)), str(refused.value)


def test_classic_meshes_are_copied() -> None:
    mesh = [0, 1]
    config = _dp(actor_model_device_mesh=mesh)
    mesh.append(2)
    config.mesh("actor").append(3)  # type: ignore[union-attr]
    assert config.actor_model_device_mesh == [0, 1] and config.meshes == {"actor": [0, 1]}


def test_the_suite_is_large_enough() -> None:
    assert len(TRAIN) + len(GRAPH) + len(CLASSIC) >= 80
