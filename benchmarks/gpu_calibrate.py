"""Calibrate the planner's constants on one GPU: time real-shape kernels, fit, write a calibration file.

A random-init model of a real shape (default Qwen2.5-1.5B's config; no download) is timed for vLLM
generation at three (batch, length) points (memory-bound, compute-bound, long), a log-prob forward and
one update step (forward + backward + AdamW) on one GPU. Each timing becomes a calibration case (the
same work costed by the planner on one GPU of this device), and ``train_mfu``, ``decode_mfu``,
``hbm_efficiency`` and ``decode_step_overhead_s`` are fitted for this device class.

    python benchmarks/gpu_calibrate.py --out calibration_gpu.json [--model qwen2.5-1.5b] [--device H200]
    python benchmarks/gpu_calibrate.py --smoke --out /tmp/cal.json   # CPU plumbing check, tiny model

Budget: model build ~30 s, vLLM start ~1-2 min, generation ~1 min, training ~1 min: under 8 minutes on
an H100/H200. Generation runs in a child process so its memory is returned before training.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hybridflow.graph import Workload, load_graph
from hybridflow.planner import Cluster, ModelSpec
from hybridflow.planner.calibration import Calibration
from hybridflow.planner.fit import fit_calibration
from hybridflow.planner.lengths import LengthDistribution
from hybridflow.planner.published import MeasuredCase
from hybridflow.planner.settings import RunSettings

PROMPT = 128
GENERATION = ((64, 512), (1024, 256), (256, 1024))  # (sequences, new tokens): memory-bound, compute-bound, long
SMOKE_GENERATION = ((4, 16), (16, 8))
TRAIN_ROWS, TRAIN_RESPONSE, TRAIN_MICRO = 16, 1024, 4
FITTED = ("train_mfu", "decode_mfu", "hbm_efficiency", "decode_step_overhead_s")
UTILIZATION = 0.6
DEVICE_NAMES = {"H200": "H200", "H100": "H100-80G", "H800": "H800", "H20": "H20", "A100": "A100-80G",
                "B200": "B200", "GB200": "GB200", "L40S": "L40S", "MI300X": "MI300X", "MI325X": "MI325X"}


def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """A Qwen2 config.json for the planner's shape (random weights are all the timings need)."""
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": spec.hidden,
            "intermediate_size": spec.intermediate, "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads, "vocab_size": spec.vocab,
            "tie_word_embeddings": spec.tie_embeddings, "max_position_embeddings": 4096, "rope_theta": 1e6,
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "torch_dtype": "bfloat16"}


def build_model_dir(spec: ModelSpec, folder: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    (folder / "config.json").write_text(json.dumps(hf_config(spec)))
    config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(folder)


def time_generation(folder: str, points: list[tuple[int, int]], smoke: bool) -> list[dict[str, float]]:
    """Runs in a child process: vLLM with all sequences submitted at once, every response forced to length."""
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(model=folder, skip_tokenizer_init=True, dtype="bfloat16" if not smoke else "float32", seed=0,
              gpu_memory_utilization=UTILIZATION, max_num_seqs=1024, max_model_len=2048)
    generator = torch.Generator().manual_seed(0)
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]

    def prompts(count: int) -> list[Any]:
        ids = torch.randint(0, vocab, (count, PROMPT), generator=generator).tolist()
        return [{"prompt_token_ids": row} for row in ids]

    def run(count: int, length: int) -> float:
        params = SamplingParams(max_tokens=length, min_tokens=length, ignore_eos=True, temperature=1.0,
                                detokenize=False)
        start = time.perf_counter()
        llm.generate(prompts(count), params, use_tqdm=False)
        return time.perf_counter() - start

    run(8, 8)  # warm-up: the first call pays lazy initialisation
    return [{"sequences": count, "tokens": length, "seconds": run(count, length)} for count, length in points]


def time_training(spec: ModelSpec, folder: Path, smoke: bool) -> dict[str, float]:
    """A log-prob forward over the rows and one optimizer step over them in micro batches."""
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rows, prompt, response = (4, 16, 16) if smoke else (TRAIN_ROWS, PROMPT, TRAIN_RESPONSE)
    length = prompt + response
    micro = 2 if smoke else TRAIN_MICRO
    ids = torch.randint(0, spec.vocab, (rows, length), device=device)
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda")

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def forward() -> float:
        sync()
        start = time.perf_counter()
        with torch.no_grad(), autocast:
            logits = model(ids).logits.float()
            torch.log_softmax(logits, dim=-1).gather(-1, ids.unsqueeze(-1))
        sync()
        return time.perf_counter() - start

    def update() -> float:
        sync()
        start = time.perf_counter()
        for chunk in ids.split(micro):
            with autocast:
                logits = model(chunk).logits.float()
                loss = -torch.log_softmax(logits, dim=-1).gather(-1, chunk.unsqueeze(-1)).mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - start

    forward(), update()  # warm-up
    return {"forward_s": min(forward() for _ in range(3)), "update_s": min(update() for _ in range(2)),
            "rows": rows, "prompt": prompt, "response": response, "micro": micro}


def cases(spec: ModelSpec, device: str, generation: list[dict[str, float]],
          training: dict[str, float]) -> list[MeasuredCase]:
    """Each timing as the same work costed by the planner on one GPU of ``device``."""
    graph = load_graph("grpo_no_ref", reward_kind="reward_function")
    cluster = Cluster.parse(f"1x{device}")
    found = []
    for point in generation:
        rows, length = int(point["sequences"]), int(point["tokens"])
        workload = Workload(batch_size=rows, prompt_len=PROMPT, response_len=length, n_samples=1)
        run = RunSettings(lengths=LengthDistribution.point(length), gpu_memory_utilization=UTILIZATION,
                          max_num_seqs=1024)
        found.append(MeasuredCase(id=f"generate {rows}x{length}", graph=graph, models={"actor": spec},
                                  workload=workload, cluster=cluster, mapping={"actor": (0,)},
                                  layout={"data_parallel_size": 1, "rollout_tp": {"actor": 1}}, settings=run,
                                  measured={"actor_generate": point["seconds"]}))
    rows = int(training["rows"])
    workload = Workload(batch_size=rows, prompt_len=int(training["prompt"]), response_len=int(training["response"]),
                        n_samples=1)
    run = RunSettings(mini_batch_size=rows)
    layout = {"data_parallel_size": 1, "micro_batch_sizes": {"actor": int(training["micro"])},
              "gradient_checkpointing": False}
    forward_layout = {"data_parallel_size": 1, "micro_batch_sizes": {"actor": rows}, "gradient_checkpointing": False}
    found.append(MeasuredCase(id="logprob forward", graph=graph, models={"actor": spec}, workload=workload,
                              cluster=cluster, mapping={"actor": (0,)}, layout=forward_layout, settings=run,
                              measured={"actor_logprob": training["forward_s"]}))
    found.append(MeasuredCase(id="update step", graph=graph, models={"actor": spec}, workload=workload,
                              cluster=cluster, mapping={"actor": (0,)}, layout=layout, settings=run,
                              measured={"actor_update": training["update_s"]}))
    return found


def detect_device(smoke: bool) -> str:
    if smoke:
        return "CPU"
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or --smoke for a CPU plumbing check")
    name = torch.cuda.get_device_name(0).upper()
    for key, device in DEVICE_NAMES.items():
        if key in name.replace("NVIDIA", "").split() or name.replace("NVIDIA ", "").startswith(key):
            return device
    raise SystemExit(f"GPU {name!r} is not in the catalogue; pass --device NAME (a catalogue device)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", required=True, help="calibration file to write")
    parser.add_argument("--model", default="qwen2.5-1.5b", help="planner preset whose shape is timed")
    parser.add_argument("--device", help="catalogue device name (default: detected)")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the plumbing only")
    parser.add_argument("--generate-only", help=argparse.SUPPRESS)  # child process: MODEL_DIR
    args = parser.parse_args(argv)
    points = list(SMOKE_GENERATION if args.smoke else GENERATION)
    if args.generate_only:
        Path(args.out).write_text(json.dumps(time_generation(args.generate_only, points, args.smoke)))
        return 0
    started = time.perf_counter()
    device = args.device or detect_device(args.smoke)
    spec = ModelSpec.preset("tiny" if args.smoke else args.model)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        folder.mkdir()
        build_model_dir(spec, folder)
        generated = Path(tmp) / "generation.json"
        child = [sys.executable, __file__, "--generate-only", str(folder), "--out", str(generated)]
        subprocess.run(child + (["--smoke"] if args.smoke else []), check=True, timeout=420)
        generation = json.loads(generated.read_text())
        training = time_training(spec, folder, args.smoke)
    measured = cases(spec, device, generation, training)
    pairs = [(case.predict, case.measured) for case in measured]
    fitted = fit_calibration(pairs, names=FITTED, devices=[device] * len(measured), min_cases_per_device=1,
                             source=f"benchmarks/gpu_calibrate.py on {device}")
    for case in measured:
        priors, after = sum(case.predict(Calibration()).values()), sum(case.predict(fitted).values())
        print(f"{case.id:<22} measured {sum(case.measured.values()):8.3f} s   priors {priors:8.3f} s   "
              f"fitted {after:8.3f} s")
    fitted.save(args.out)
    Path(args.out).with_suffix(".measurements.json").write_text(json.dumps(
        {"device": device, "model": spec.name, "generation": generation, "training": training}, indent=2))
    print(f"wrote {args.out} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
