"""Size-like config keys are bounded before anything is read or allocated: one error naming the key, its value,
the bound and the fix (hybridflow/train/bounds.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hybridflow.train.bounds import ROW_BYTES, check_model_size, host_memory_bytes
from hybridflow.train.config import config_from_dotted
from hybridflow.train.prepare import prepare_run


def _refused(items: dict, tmp_path: Path) -> str:
    config = config_from_dotted({"output_dir": str(tmp_path / "run"), **items})
    with pytest.raises(ValueError) as caught:
        prepare_run(config)
    assert not (tmp_path / "run").exists()
    return str(caught.value)


def test_an_absurd_number_of_examples_is_refused_in_well_under_a_second(tmp_path: Path) -> None:
    started = time.perf_counter()
    message = _refused({"data.num_examples": 10_000_000_000}, tmp_path)
    assert time.perf_counter() - started < 1.0  # before: 96 s, then a MemoryError
    high = host_memory_bytes() // ROW_BYTES
    assert message.startswith(f"config key 'data.num_examples'=10000000000 exceeds {high}: ")
    assert "host memory" in message and "data.path" in message and "\n" not in message


@pytest.mark.parametrize(("items", "key", "high"), [
    ({"model.sft_batch_size": 10**12}, "model.sft_batch_size", 1 << 22),
    ({"optim.actor.micro_batch_size": 10**12}, "optim.actor.micro_batch_size", 1 << 22),
    ({"roles.actor.micro_batch_size": 10**12}, "roles.actor.micro_batch_size", 1 << 22),
    ({"algorithm.options.max_new_tokens": 10**12}, "algorithm.options.max_new_tokens", 255),  # tiny: context 256
    ({"data.max_prompt_length": 10**12}, "data.max_prompt_length", 1 << 20),
    ({"roles.actor.lora.rank": 10**9}, "roles.actor.lora.rank", 128),  # tiny-qwen2's hidden_size
    ({"pipeline.mode": "async", "pipeline.segment_tokens": 10**12}, "pipeline.segment_tokens", 255),
    ({"agent.environment": "calculator", "agent.max_turn_tokens": 10**12}, "agent.max_turn_tokens", 255),
])
def test_every_size_like_key_has_a_bound_named_in_its_error(items: dict, key: str, high: int,
                                                             tmp_path: Path) -> None:
    message = _refused(items, tmp_path)
    assert message.startswith(f"config key {key!r}={items[key]} exceeds {high}: "), message


def test_values_at_the_bound_pass_the_size_checks() -> None:
    from hybridflow.train.bounds import check_sizes
    from hybridflow.train.setup import build_graph

    config = config_from_dotted({"roles.actor.lora.rank": 128, "algorithm.options.max_new_tokens": 255})
    check_sizes(config, build_graph(config))


def test_a_model_directory_is_bounded_by_its_config_json(tmp_path: Path) -> None:
    sizes = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "vocab_size": 128256,
             "intermediate_size": 8192}
    (tmp_path / "config.json").write_text(json.dumps(sizes))
    check_model_size("model.path", str(tmp_path))  # Llama 3.2 1B's shape: 2.5 GB in bf16
    (tmp_path / "config.json").write_text(json.dumps({**sizes, "num_hidden_layers": 10**9}))
    with pytest.raises(ValueError, match=r"config key 'model.path': .*config.json describes about .* weights .* more "
                                         r"than this machine's .* memory"):
        check_model_size("model.path", str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**sizes, "hidden_size": "wide"}))
    with pytest.raises(ValueError, match=r"config.json has hidden_size='wide', which must be a positive integer"):
        check_model_size("model.path", str(tmp_path))
