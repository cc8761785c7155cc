"""Loading HF models for each role kind and the sequence-level forward passes they share."""

from __future__ import annotations

import inspect
import threading
from pathlib import Path
from typing import Any

import torch
from hybridflow.backends.common import packing, peft_lora, sampling, varlen, vision

from hybridflow.fields import FieldError
from hybridflow.graph import RoleKind
from hybridflow.logits import token_entropy, token_logprobs
from hybridflow.models import vision as models_vision
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import AdapterSpec
from hybridflow.runtime.weights import DTYPES

# HF loading switches process-global state (meta-device init, default dtype): ranks that share a
# process (local executor) must load one at a time.
_LOAD_LOCK = threading.Lock()


def load_model(kind: RoleKind, model: str, *, dtype: str = "fp32", seed: int = 0, lora: AdapterSpec | None = None,
               role: str = "") -> Any:
    """The HF module a role of ``kind`` needs, from a local directory or a built-in tiny config name.

    Policies load a causal LM; critics a token-classification head (one value per token); reward
    models a sequence-classification head. A tiny config name builds a random model for the default
    character tokenizer. With ``lora`` (``role``'s adapters) the result is a peft model whose adapters alone
    train (:mod:`~hybridflow.backends.common.peft_lora`): every training backend loads through here.
    """
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    with _LOAD_LOCK:
        torch.manual_seed(seed)  # fresh heads (value, score) and adapters start the same on every rank
        module = _load(kind, model, dtype)
        return peft_lora.apply_adapters(module, lora, role=role) if lora is not None else module


def _load(kind: RoleKind, model: str, dtype: str) -> Any:
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    classes = {RoleKind.VALUE: AutoModelForTokenClassification,
               RoleKind.REWARD_MODEL: AutoModelForSequenceClassification}
    cls = classes.get(kind, AutoModelForCausalLM)
    head = {"num_labels": 1} if kind in classes else {}
    if Path(model).is_dir() and _is_vision_language(model):
        from transformers import AutoModelForImageTextToText

        module = AutoModelForImageTextToText.from_pretrained(model, dtype=DTYPES[dtype])
        if kind in classes:  # no transformers head class takes images: the VLM itself with a one-wide head
            with_scalar_head(module)
    elif Path(model).is_dir():
        module = cls.from_pretrained(model, dtype=DTYPES[dtype], **head)
    else:
        from hybridflow.models import tiny_config
        from hybridflow.models.tokenizer import char_tokenizer

        if not model.startswith("tiny-"):
            raise FileNotFoundError(f"model {model!r} is neither a local directory nor a built-in tiny config")
        config = tiny_config(model, vocab_size=len(char_tokenizer()))
        for key, value in head.items():
            setattr(config, key, value)
        module = cls.from_config(config, dtype=DTYPES[dtype])
    text = getattr(module.config, "text_config", None)
    if text is not None and text is not module.config:  # a VLM's token ids live in its text config
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(module.config, name, None) is None:
                setattr(module.config, name, getattr(text, name, None))
    if getattr(module.config, "pad_token_id", None) is None:
        module.config.pad_token_id = module.config.eos_token_id
    varlen.enable(module)  # packed passes attend per sequence instead of through an N² mask
    return module


def with_scalar_head(model: Any) -> None:
    """Make a vision-language model a value or reward model: its LM head becomes a fresh ``Linear(hidden, 1)``
    (as transformers' token- and sequence-classification heads, ``num_labels=1``), so ``logits`` (B, L, 1) are
    per-token scalars that read the images through the same forward as the policy's. The head is untied from the
    input embeddings (a tied head would be the embeddings)."""
    head = model.get_output_embeddings()
    text = model.config.get_text_config()
    scalar = torch.nn.Linear(head.in_features, 1, dtype=head.weight.dtype)
    torch.nn.init.normal_(scalar.weight, std=float(getattr(text, "initializer_range", 0.02)))
    torch.nn.init.zeros_(scalar.bias)
    model.set_output_embeddings(scalar)
    for config in {id(model.config): model.config, id(text): text}.values():
        config.tie_word_embeddings = False
    model.config.num_labels = 1



def _is_vision_language(directory: str) -> bool:
    """Whether the model in ``directory`` has a vision tower (its config a ``vision_config``): loaded as an
    image-text-to-text model, since no causal-LM class takes its images."""
    from transformers import AutoConfig

    return models_vision.is_vision_language(AutoConfig.from_pretrained(directory))


def vision_tower(model: Any) -> tuple[str, torch.nn.Module] | None:
    """(module path in ``model``, module) of a vision-language model's vision tower under any wrapper (peft), as
    :func:`hybridflow.models.vision.vision_tower` finds it in the transformers model; None for a text model."""
    found = models_vision.vision_tower(hf_model(model))
    if found is None:
        return None
    tower = found[1]
    return next(name for name, module in model.named_modules() if module is tower), tower


def freeze_vision_tower(model: Any, *, role: str, source: str) -> str:
    """Freeze ``model``'s vision tower (no gradients, so no optimizer state); returns its module path, the prefix
    of its state-dict names. A model without one is refused naming the key."""
    found = vision_tower(model)
    if found is None:
        raise FieldError("freeze_vision_tower", True, f"for role {role!r}: model {source} "
                         f"({type(hf_model(model)).__name__}) has no vision tower; set it false")
    path, tower = found
    tower.requires_grad_(False)
    return path


def sequence_inputs(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids``, ``attention_mask``, ``position_ids`` for prompt + response rows. Shapes (B, P + T)."""
    input_ids = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1).long()
    # Left padding shifts positions; count them from the first real token as generate() does.
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return input_ids, mask, positions


def policy_outputs(model: Any, batch: Batch, *, with_entropy: bool, packed: bool = True) -> dict[str, torch.Tensor]:
    """Log-probs (and entropy) of the response tokens. Each (B, T); 0 where ``response_mask`` is 0 when ``packed``.
    Rows with images (:mod:`.vision`) also pass the model their pixel values, image grids and 3-D rope positions."""
    _refuse_blind(model, batch, "log-prob")
    if packed:
        rows = _pack(model, batch)
        inputs = _packed_inputs(model, batch, rows)
        if keeps_logits(model):  # the LM head on the M emitting tokens only, not all N packed ones (TRL's trim)
            logits = model(input_ids=rows.input_ids, use_cache=False, logits_to_keep=rows.emit, **inputs).logits[0]
        else:
            logits = model(input_ids=rows.input_ids, use_cache=False, **inputs).logits[0, rows.emit]
        targets = batch["responses"][rows.rows, rows.cols]
        out = {"logprobs": rows.scatter(token_logprobs(logits, targets))}  # (M, V) -> (M,) -> (B, T)
        if with_entropy:
            out["entropy"] = rows.scatter(token_entropy(logits))
        return out
    input_ids, mask, positions = sequence_inputs(batch)
    prompt_len, response_len = batch["prompts"].shape[1], batch["responses"].shape[1]
    inputs = _padded_inputs(model, batch, input_ids, mask, positions)
    if keeps_logits(model):  # the last T + 1 positions, P - 1 .. P + T - 1: the first T predict the responses
        logits = model(input_ids=input_ids, attention_mask=mask, use_cache=False, logits_to_keep=response_len + 1,
                       **inputs).logits[:, :response_len]
    else:
        logits = model(input_ids=input_ids, attention_mask=mask, use_cache=False, **inputs).logits
        logits = logits[:, prompt_len - 1:prompt_len - 1 + response_len]  # position t predicts token t + 1
    out = {"logprobs": token_logprobs(logits, batch["responses"])}
    if with_entropy:
        out["entropy"] = token_entropy(logits)
    return out


def _packed_inputs(model: Any, batch: Batch, rows: packing.PackedRows) -> dict[str, Any]:
    """The packed pass's position ids; with images, their pixel values, grids and each sequence's 3-D positions."""
    if vision.has_images(batch):  # each sequence keeps the 3-D rope positions the model gives it alone
        return vision.packed_inputs(hf_model(model), batch, *sequence_inputs(batch)[:2], rows.position_ids)
    return {"position_ids": rows.position_ids}


def _padded_inputs(model: Any, batch: Batch, input_ids: torch.Tensor, mask: torch.Tensor,
                   positions: torch.Tensor) -> dict[str, Any]:
    """The padded pass's position ids; with images, their pixel values, grids and the model's 3-D positions."""
    if vision.has_images(batch):
        return vision.padded_inputs(hf_model(model), batch, input_ids, mask)
    return {"position_ids": positions}


def keeps_logits(model: Any) -> bool:
    """Whether the HF model under any wrapper takes ``logits_to_keep`` (transformers' causal LMs: a tensor of
    positions runs the LM head on those alone), so a pass over a long prompt projects only the response tokens."""
    inner = _hf_module(model)
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # a peft model's HF model
    cls = type(base)
    if cls not in _KEEPS_LOGITS:
        _KEEPS_LOGITS[cls] = "logits_to_keep" in inspect.signature(cls.forward).parameters
    return _KEEPS_LOGITS[cls]


_KEEPS_LOGITS: dict[type, bool] = {}  # per model class: its forward's signature does not change


def value_outputs(model: Any, batch: Batch, *, packed: bool = True) -> dict[str, torch.Tensor]:
    """Per-token values (B, T): the value head at the position that *emits* each response token. A
    vision-language critic (:func:`with_scalar_head`) reads the rows' images as the policy's passes do."""
    _refuse_blind(model, batch, "value")
    if packed:
        rows = _pack(model, batch)
        values = model(input_ids=rows.input_ids, use_cache=False, **_packed_inputs(model, batch, rows)).logits
        return {"values": rows.scatter(values[0, rows.emit, 0].float())}
    input_ids, mask, positions = sequence_inputs(batch)
    prompt_len, response_len = batch["prompts"].shape[1], batch["responses"].shape[1]
    values = model(input_ids=input_ids, attention_mask=mask,
                   **_padded_inputs(model, batch, input_ids, mask, positions)).logits.squeeze(-1)
    return {"values": values[:, prompt_len - 1:prompt_len - 1 + response_len].float()}


def reward_model_scores(model: Any, batch: Batch, *, packed: bool = True) -> torch.Tensor:
    """(B,) scores of a sequence-classification model at each row's last real token (a vision-language reward
    model's, :func:`with_scalar_head`, from its per-token head there, with the rows' images)."""
    _refuse_blind(model, batch, "score")
    if vision.placeholder_ids(hf_model(model)):
        return _vision_scores(model, batch, packed=packed)
    if packed:
        return _packed_scores(model, batch)
    input_ids, mask, positions = sequence_inputs(batch)
    # HF pools at the last non-pad token, so every masked position must hold the pad id.
    input_ids = input_ids.masked_fill(mask == 0, model.config.pad_token_id)
    return model(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits[:, 0].float()


def _vision_scores(model: Any, batch: Batch, *, packed: bool) -> torch.Tensor:
    if packed:
        rows = _pack(model, batch)
        scores = model(input_ids=rows.input_ids, use_cache=False, **_packed_inputs(model, batch, rows)).logits
        return scores[0, rows.last, 0].float()
    input_ids, mask, positions = sequence_inputs(batch)
    scores = model(input_ids=input_ids, attention_mask=mask, use_cache=False,
                   **_padded_inputs(model, batch, input_ids, mask, positions)).logits[..., 0]  # (B, P + T)
    last = mask.shape[1] - 1 - mask.flip(1).argmax(dim=1)  # each row's last real token (responses pad on the right)
    return scores[torch.arange(len(last)), last].float()


def _packed_scores(model: Any, batch: Batch) -> torch.Tensor:
    # HF pools one score per batch row, and a packed batch is one row: read the head's per-token output instead.
    head = getattr(_hf_module(model), "score", None)
    if not isinstance(head, torch.nn.Module):
        raise NotImplementedError(f"packed reward scores read the score head of the model; {type(model).__name__} "
                                  "has no `score` module: set the role's layout padding=true")
    rows = _pack(model, batch)
    captured: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda _module, _inputs, output: captured.append(output))
    try:
        model(input_ids=rows.input_ids, position_ids=rows.position_ids, use_cache=False)
    finally:
        handle.remove()
    return captured[0][0, rows.last, 0].float()  # (1, N, labels) -> (B,)


def _refuse_blind(model: Any, batch: Batch, kind: str) -> None:
    # A text head would read the image placeholders without the images: refused rather than silently blind.
    if vision.has_images(batch) and not vision.placeholder_ids(hf_model(model)):
        raise NotImplementedError(f"{kind} passes over rows with images need a vision-language model; "
                                  f"{type(hf_model(model)).__name__} is a text model: give the role the policy's "
                                  "VLM (or another with the same processor) as its model")


def _pack(model: Any, batch: Batch) -> packing.PackedRows:
    config = _hf_module(model).config
    packing.check_packable(config)
    return packing.pack(batch, pad_id=config.pad_token_id)


def _hf_module(model: Any) -> Any:
    """The HF model under a training wrapper (a DeepSpeed engine holds it as ``module``)."""
    return getattr(model, "module", model)


def hf_model(model: Any) -> Any:
    """The transformers model under any wrapper: a DeepSpeed engine's ``module``, a peft model's base model."""
    inner = _hf_module(model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def join_responses(parts: list[dict[str, torch.Tensor]], *, pad: int) -> dict[str, torch.Tensor]:
    """Generate outputs of consecutive row waves as one: response-aligned fields right-padded to the longest
    (``responses`` with ``pad``, masks and log-probs with 0)."""
    width = max(part["responses"].shape[1] for part in parts)
    joined = {}
    for name in parts[0]:
        filler = pad if name == "responses" else 0
        joined[name] = torch.cat([torch.nn.functional.pad(part[name], (0, width - part[name].shape[1]), value=filler)
                                  for part in parts])
    return joined


def generate(model: Any, batch: Batch, *, max_new_tokens: int, greedy: bool, temperature: float, top_p: float,
             top_k: int, seed: int, use_hf_generate: bool = False, logprobs: bool = False) -> dict[str, torch.Tensor]:
    """One sample per prompt row; responses trimmed to the longest and masked after the first EOS.

    The lean cached loop (:func:`sampling.sample`) is the default; ``use_hf_generate`` runs HF
    ``generate`` instead (same options, same greedy output; for models with custom generation code).
    With ``logprobs`` the result also holds ``rollout_logprobs`` (B, T), float32, 0 where ``response_mask``
    is 0: each sampled token's log-prob under the trainer's definition (:func:`policy_outputs`: the
    log-softmax of the raw logits, whatever the temperature, top-k or top-p that sampled it).
    """
    config = model.config
    eos, pad = config.eos_token_id, config.pad_token_id
    prompts = batch["prompts"]
    if use_hf_generate:
        responses, chosen = _hf_generate(model, batch, max_new_tokens=max_new_tokens, greedy=greedy,
                                         temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                         logprobs=logprobs)
    else:
        prefill = None
        if vision.reads_images(hf_model(model), batch):  # pixel values, image grids, the prompts' 3-D positions
            prefill = vision.padded_inputs(hf_model(model), batch, prompts, batch["prompt_mask"].long())
        responses, chosen = sampling.sample(model, prompts, batch["prompt_mask"], max_new_tokens=max_new_tokens,
                                            greedy=greedy, temperature=temperature, top_p=top_p, top_k=top_k,
                                            seed=seed, eos=eos, pad=pad, logprobs=logprobs, prefill=prefill,
                                            suppress=vision.placeholder_ids(hf_model(model)))
    is_eos = (responses == eos).long()
    # Keep tokens up to and including the first EOS: no EOS strictly before the position.
    mask = (is_eos.cumsum(dim=1) - is_eos == 0).long()
    width = max(int(mask.sum(dim=1).max()), 1)
    responses = responses.masked_fill(mask == 0, pad)[:, :width].contiguous()
    out = {"responses": responses, "response_mask": mask[:, :width].contiguous()}
    if chosen is not None:
        out["rollout_logprobs"] = chosen.masked_fill(mask == 0, 0.0)[:, :width].contiguous()
    return out


def _hf_generate(model: Any, batch: Batch, *, max_new_tokens: int, greedy: bool, temperature: float, top_p: float,
                 top_k: int, seed: int, logprobs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """HF ``generate``: the continuations (B, T') and, with ``logprobs``, the sampled tokens' log-probs (B, T').

    The log-probs come from ``output_logits`` (the unprocessed logits of every step): exact, but held as
    (B, T', V) float32 until ``generate`` returns; the native loop keeps one step's.
    """
    from transformers import GenerationConfig

    config, prompts = model.config, batch["prompts"]
    options: dict[str, Any] = {} if greedy else {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    suppress = vision.placeholder_ids(hf_model(model))
    if suppress:
        options["suppress_tokens"] = list(suppress)
    gen_config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=not greedy, eos_token_id=config.eos_token_id,
                                  pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id,
                                  return_dict_in_generate=logprobs, output_logits=logprobs, **options)
    images: dict[str, Any] = {}
    if vision.reads_images(hf_model(model), batch):  # the model computes its 3-D rope positions from these
        pixel_values, grid_thw = vision.image_inputs(batch, device=prompts.device)
        if pixel_values is not None:
            images = {"pixel_values": pixel_values, "image_grid_thw": grid_thw,
                      "mm_token_type_ids": vision.token_types(hf_model(model), prompts)}
    torch.manual_seed(seed)
    out = model.generate(input_ids=prompts, attention_mask=batch["prompt_mask"], generation_config=gen_config,
                         **images)
    if not logprobs:
        return out[:, prompts.shape[1]:], None
    responses = out.sequences[:, prompts.shape[1]:]
    logits = torch.stack(out.logits, dim=1)  # (B, T', V): step t's logits sampled token t
    return responses, token_logprobs(logits, responses).float()


def tied_weights(module: torch.nn.Module) -> dict[str, str]:
    """``{alias: name}`` for parameters a module holds twice under two names (tied embeddings).

    A state dict lists a tied ``lm_head.weight`` beside ``embed_tokens.weight``; only one needs to travel.
    """
    first: dict[int, str] = {}
    aliases = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases
