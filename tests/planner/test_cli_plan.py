"""``hybridflow plan``: the seed's dry run, JSON output, manual comparison and infeasible input."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from hybridflow.cli import main

from .conftest import SEED_MAPPING

SEED = ["plan", "--algorithm", "ppo", "--cluster", "8xA100-80G", "--model", "actor=llama3-8b", "--model",
        "critic=llama3-8b", "--model", "reward=llama3-8b", "--model", "reference=llama3-8b", "--batch-size", "1024",
        "--prompt-len", "512", "--response-len", "512"]
GROUP_KEYS = {"gpus", "device", "roles", "memory_per_gpu_bytes", "capacity_bytes", "layouts"}


def test_seed_dry_run_json_with_manual(capsys):
    assert main([*SEED, "--manual", SEED_MAPPING, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for plan in (data, data["manual"]):
        assert {"feasible", "step_time_s", "cross_group_bytes", "groups", "nodes", "bottleneck", "search"} <= set(plan)
        assert all(set(group) >= GROUP_KEYS for group in plan["groups"])
    assert data["feasible"] and data["step_time_s"] < data["manual"]["step_time_s"]
    assert "faster" in data["comparison"]


def test_seed_dry_run_table_imports_no_torch(tmp_path):
    code = ("import sys, time; t = time.perf_counter(); from hybridflow.cli import main; "
            f"rc = main({[*SEED, '--manual', SEED_MAPPING]!r}); "
            "assert 'torch' not in sys.modules; print('SECONDS', time.perf_counter() - t); sys.exit(rc)")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)  # outside the checkout, so the installed package is imported
    assert done.returncode == 0, done.stderr
    assert "auto plan" in done.stdout and "manual mapping" in done.stdout and "step time:" in done.stdout
    seconds = float(done.stdout.split("SECONDS")[1].split()[0])
    # a guard against a search that blows up, not a speed target (about 0.5 s idle; timings live in benchmarks/)
    assert seconds < 30, f"dry run took {seconds:.2f} s (whole process {time.perf_counter() - start:.2f} s)"


def test_infeasible_input_exits_non_zero_naming_the_shortfall(capsys):
    code = main(["plan", "--cluster", "2xT4", "--model", "llama3-70b", "--batch-size", "8"])
    err = capsys.readouterr().err
    assert code == 1
    assert "role 'actor' (llama3-70b)" in err and "over by" in err and "GiB" in err


def test_manual_oom_exits_non_zero(capsys):
    code = main([*SEED, "--manual", "actor=0,critic=0,reward=1,reference=1", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and not data["manual"]["feasible"] and "OOM risk" in data["manual"]["problems"][0]


def test_config_file_and_bare_model(tmp_path, capsys):
    config = tmp_path / "plan.yaml"
    config.write_text("algorithm: grpo\ncluster: 4xA100-80G\nmodels: {actor: qwen2.5-0.5b}\nbatch_size: 64\n")
    assert main(["plan", "--config", str(config), "--model", "qwen2.5-1.5b", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["algorithm"] == "grpo" and data["feasible"]


def test_bad_cli_input_is_a_clean_error(capsys):
    assert main(["plan", "--cluster", "8xB300", "--model", "llama3-8b"]) == 2
    assert "unknown device 'B300'" in capsys.readouterr().err
    assert main(["plan", "--cluster", "8xA100", "--model", "actor=llama3-8b", "--model", "actor=qwen2.5-7b"]) == 2
    assert "names role 'actor' twice" in capsys.readouterr().err
    assert main(["plan", "--cluster", "8xA100", "--model", "actor=llama3-8b"]) == 2
    assert "no model for role" in capsys.readouterr().err
    assert main(["plan", "--cluster", "8xA100", "--model", "llama3-8b", "--batch-size", "-4"]) == 2
    assert "--batch-size=-4 must be at least 1" in capsys.readouterr().err
