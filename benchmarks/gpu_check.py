"""A GPU check ready to fire: GRPO on every training backend and layout of one device, the planner's predictions
beside what ran (``planner_self`` on a real GPU), each part in a process of its own under its own time limit.

    make gpu-check        # GPU mode: Qwen2.5-0.5B's shape, random init, bf16; python3 benchmarks/gpu_check.py
    make gpu-check-cpu    # CPU mode: the tiny model, fp32, gloo; python3 benchmarks/gpu_check.py --cpu

The parts (``benchmarks/gpu_check_parts.py``): the packed-attention kernel check; GRPO steps on the torch backend
with and without gradient checkpointing, on FSDP2 (one rank, NCCL), FSDP2 with CPU offload, DeepSpeed ZeRO-2 and
ZeRO-3 (where ``deepspeed`` imports), and LoRA. Each reports pass, fail or skipped (with the reason) and its
seconds; a GRPO part also the measured and predicted seconds of every phase and the measured
(``torch.cuda.max_memory_allocated``) and predicted peak memory, as ratios predicted / measured, which are
reported, not judged. Writes ``report.json``, ``report.md`` and one log per part to ``--out``; exits 1 when a part
failed or did not run within the budget (``--budget``: the whole check, GPU mode 360 s; CPU mode 300 s).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu_check_parts import PARTS, Part
from gpu_check_report import markdown

PARTS_SCRIPT = Path(__file__).resolve().parent / "gpu_check_parts.py"
LIMITS = {"cuda": {"model": 120, "attention": 60, "grpo": 90}, "cpu": {"model": 60, "attention": 60, "grpo": 90}}
BUDGETS = {"cuda": 360, "cpu": 300}
MIN_PART_S = 15  # a part that cannot have this long is reported as not run


def skip_reason(part: Part, mode: str, named: bool) -> str | None:
    """Why ``part`` does not run here (None: it runs). A part named with ``--parts`` runs on a CPU even where
    CPU mode would leave it out for time."""
    if mode == "cpu" and part.cuda_only:
        return f"CPU mode: {part.cuda_only}"
    missing = [module for module in part.needs if importlib.util.find_spec(module) is None]
    if missing:
        return f"{', '.join(missing)} is not installed (GPU check in docs/benchmarks.md: carry its wheel)"
    if mode == "cpu" and part.cpu_skip and not named:
        return f"CPU mode: {part.cpu_skip}; name it in --parts to run it"
    return None


def run_part(command: list[str], *, limit: float, log: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``command`` in a session of its own, output to ``log``; past ``limit`` seconds the whole session is
    killed (its own children too: a hung NCCL call or reward worker). Status pass or fail with the reason."""
    started = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            seconds = time.perf_counter() - started
            return {"status": "fail", "reason": f"timed out after {limit:.0f} s", "seconds": seconds}
    seconds = time.perf_counter() - started
    if code != 0:
        return {"status": "fail", "reason": f"exit code {code}: {last_line(log)}", "seconds": seconds}
    return {"status": "pass", "reason": "", "seconds": seconds}


def last_line(log: Path) -> str:
    """The last non-empty line of a log (an exception's message)."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:500] if lines else "(no output)"


def child_env(mode: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    if mode == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU mode on a GPU machine stays on the CPU (plans name logical GPUs)
    return env


def check_part(name: str, mode: str, work: Path, out: Path, limit: float) -> dict[str, Any]:
    """One part (or the model build) in its own process; its result file merged into the row."""
    result_file = work / f"{name}.result.json"
    command = [sys.executable, str(PARTS_SCRIPT), "--part", name, "--mode", mode, "--work", str(work),
               "--result", str(result_file)]
    row = run_part(command, limit=limit, log=out / "logs" / f"{name}.log", env=child_env(mode))
    row.update(limit_s=limit, log=f"logs/{name}.log")
    if name != "model":
        shutil.rmtree(work / name, ignore_errors=True)  # its run directory: ~1 GB a part in GPU mode (the export)
    if row["status"] == "pass" and not result_file.is_file():
        row.update(status="fail", reason="the part exited 0 without writing its result")
    if row["status"] == "pass":
        row["result"] = json.loads(result_file.read_text())
        problems = row["result"].get("problems") or []
        if problems:
            row.update(status="fail", reason="; ".join(problems))
    return row


def run_check(mode: str, out: Path, work: Path, *, budget: float, only: set[str] | None) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    started = time.perf_counter()
    deadline = started + budget
    limits = LIMITS[mode]
    model = check_part("model", mode, work, out, min(limits["model"], budget))
    rows = [{"name": "model", "summary": "build the random-init policy and its tokenizer", **model}]
    print(f"gpu_check: {'model':<20} {model['status']:<8} {model['seconds']:6.1f} s  {model['reason']}", flush=True)
    for part in PARTS:
        if only is not None and part.name not in only:
            continue
        row: dict[str, Any] = {"name": part.name, "summary": part.summary}
        remaining = deadline - time.perf_counter()
        reason = skip_reason(part, mode, named=only is not None)
        if reason is not None:
            row.update(status="skipped", reason=reason, seconds=0.0)
        elif model["status"] != "pass":
            row.update(status="fail", reason="not run: the model build failed", seconds=0.0)
        elif remaining < MIN_PART_S:
            row.update(status="fail", reason=f"not run: the check's {budget:.0f} s budget ran out", seconds=0.0)
        else:
            limit = min(limits["attention" if part.name == "attention" else "grpo"], remaining)
            row.update(check_part(part.name, mode, work, out, limit))
        rows.append(row)
        print(f"gpu_check: {row['name']:<20} {row['status']:<8} {row['seconds']:6.1f} s  {row['reason']}", flush=True)
    environment = model.get("result", {}).get("environment", {})
    return {"mode": mode, "environment": environment, "budget_s": budget, "seconds": time.perf_counter() - started,
            "passed": all(row["status"] != "fail" for row in rows), "parts": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU mode: tiny model, fp32, gloo (what CI runs)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "runs/gpu_check"),
                        help="report.json, report.md and logs/ (default: $OUT, else runs/gpu_check)")
    parser.add_argument("--parts", default="", help=f"comma-separated subset of {[p.name for p in PARTS]}")
    parser.add_argument("--budget", type=float, help="seconds for the whole check (GPU mode 360, CPU mode 300)")
    parser.add_argument("--work", type=Path, help="model and run directories (default: a temporary one, removed)")
    args = parser.parse_args(argv)
    if "torch" not in {point.name for point in importlib.metadata.entry_points(group="hybridflow.backends")}:
        raise SystemExit("gpu_check: hybridflow's entry points are missing (it is not installed): run `make gpu-check`"
                         " or `make gpu-check-cpu`, which write them (benchmarks/gpu_check_site.py)")
    mode = "cpu" if args.cpu else "cuda"
    only = {name for name in args.parts.split(",") if name} or None
    unknown = sorted((only or set()) - {part.name for part in PARTS})
    if unknown:
        parser.error(f"--parts: unknown {unknown}; parts: {[p.name for p in PARTS]}")
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_check_"))  # runs and the model stay out of --out
    try:
        report = run_check(mode, args.out, work, budget=args.budget or BUDGETS[mode], only=only)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    (args.out / "report.md").write_text(markdown(report))
    verdict = "passed" if report["passed"] else "FAILED"
    print(f"gpu_check: {verdict} in {report['seconds']:.0f} s; {args.out / 'report.md'}", flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
