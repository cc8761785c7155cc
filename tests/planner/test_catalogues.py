"""Devices, models and clusters: catalogue figures, parsing, and errors that name the bad input."""

from __future__ import annotations

import json

import pytest

from hybridflow.planner import DEVICES, Cluster, ModelSpec, get_device

REQUIRED = ("A100-40G", "A100-80G", "H100-80G", "H200", "L40S", "A10G", "T4", "V100-32G", "RTX-4090", "MI300X")


def test_catalogue_has_every_required_device_with_a_source():
    for name in REQUIRED:
        device = DEVICES[name]
        assert device.memory_bytes > 0 and device.hbm_bandwidth > 0 and device.link_bandwidth > 0
        assert device.source and device.link in ("NVLink", "PCIe", "Infinity Fabric")


def test_turing_and_volta_have_no_bf16():
    for name in ("T4", "V100-32G"):
        assert not DEVICES[name].supports("bf16") and DEVICES[name].preferred_dtype == "fp16"
    assert DEVICES["A100-80G"].preferred_dtype == "bf16"
    assert DEVICES["H100-80G"].peak_flops("bf16") > 3 * DEVICES["A100-80G"].peak_flops("bf16")


def test_unknown_device_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown device 'B300'.*A100-80G"):
        get_device("B300")
    assert get_device("h100").name == "H100-80G"


def test_model_presets_match_their_public_parameter_counts():
    expected = {"llama3-8b": 8.03e9, "llama3-70b": 70.6e9, "qwen2.5-0.5b": 0.494e9, "qwen2.5-7b": 7.62e9,
                "qwen2.5-72b": 72.7e9}
    for name, params in expected.items():
        assert ModelSpec.preset(name).params == pytest.approx(params, rel=0.01), name
    llama = ModelSpec.preset("llama3-8b")
    assert (llama.layers, llama.hidden, llama.heads, llama.kv_heads, llama.vocab) == (32, 4096, 32, 8, 128256)
    assert 1e5 < ModelSpec.preset("tiny").params < 1e6 and ModelSpec.preset("tiny-qwen2").hidden == 128


def test_model_from_hf_config_and_from_params(tmp_path):
    config = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
              "vocab_size": 128256, "intermediate_size": 8192, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = ModelSpec.from_hf_config(tmp_path)
    assert spec.params == ModelSpec.preset("llama3.2-1b").params and spec.kv_heads == 8
    guess = ModelSpec.from_params(7e9)
    assert guess.params == 7_000_000_000 and guess.hidden % 64 == 0 and guess.heads % guess.kv_heads == 0
    assert ModelSpec.parse("8B").params == 8_000_000_000


def test_bad_model_inputs_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="unknown model preset 'gpt-9'"):
        ModelSpec.preset("gpt-9")
    with pytest.raises(ValueError, match="params=-5"):
        ModelSpec(name="x", params=-5, layers=1, hidden=64, heads=1, kv_heads=1, vocab=10)
    with pytest.raises(ValueError, match="positive"):
        ModelSpec.from_params(-1)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="lacks 'num_hidden_layers'"):
        ModelSpec.from_hf_config(tmp_path / "config.json")


@pytest.mark.parametrize(("spec", "machines", "gpus", "devices"), [
    ("8xA100-80G", 1, 8, ("A100-80G",)),
    ("2x8xH100", 2, 16, ("H100-80G",)),
    ("4xA100-80G+2xT4", 2, 6, ("A100-80G", "T4")),
    ("2xCPU", 1, 2, ("CPU",)),
])
def test_cluster_specs(spec, machines, gpus, devices):
    cluster = Cluster.parse(spec)
    assert (len(cluster.machines), cluster.num_gpus, cluster.device_names) == (machines, gpus, devices)
    assert cluster.machine_of(gpus - 1).device.name == devices[-1]


@pytest.mark.parametrize(("spec", "message"), [
    ("8xB300", "unknown device 'B300'"),
    ("8x", "malformed"),
    ("0xA100", "must be >= 1"),
    ("", "empty"),
    ("8xA100++2xT4", "malformed"),
])
def test_bad_cluster_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        Cluster.parse(spec)


def test_cluster_from_yaml(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("inter_node_bandwidth_gbs: 50\nnodes:\n  - {type: H100, gpus: 8, count: 2}\n"
                    "  - gpus: {A100-80G: 4, T4: 2}\n")
    cluster = Cluster.from_yaml(path)
    assert cluster.num_gpus == 22 and cluster.inter_node_bandwidth == 50e9
    assert [m.host for m in cluster.machines] == [0, 1, 2, 2]
    path.write_text("nodes:\n  - {type: H100}\n")
    with pytest.raises(ValueError, match=r"nodes\[0\] needs 'type' and a positive integer 'gpus'"):
        Cluster.from_yaml(path)
