"""New catalogue devices, devices defined in cluster YAML or on the CLI, and errors that name the field."""

from __future__ import annotations

import re

import pytest

from hybridflow.cli import main
from hybridflow.planner import DEVICES, Cluster, get_device
from hybridflow.planner.devices import GB, GIB, TFLOPS, parse_device

NEW = ("H20", "H20-141G", "H800", "B200", "GB200", "MI325X")


def test_new_devices_have_datasheet_figures_and_sources():
    for name in NEW:
        device = DEVICES[name]
        assert device.source and device.peak_flops("bf16") > 0 and device.host_bandwidth > 0
    assert get_device("H20-96GB").name == "H20" and DEVICES["H20"].memory_bytes == 96 * GIB
    assert DEVICES["H20"].peak_flops("bf16") < DEVICES["H100-80G"].peak_flops("bf16") / 6  # compute-poor Hopper
    assert DEVICES["H800"].link_bandwidth < DEVICES["H100-80G"].link_bandwidth



def test_gemm_ceilings_are_measured_fractions_and_fall_as_the_peak_rises():
    """MAMF over the datasheet (devices.py): a compute-poor H20 keeps nearly its peak, an H100 or B200 loses a fifth;
    a device without a measurement keeps its datasheet."""
    ceilings = {name: DEVICES[name].matmul_fraction for name in ("H20", "A100-80G", "H100-80G", "B200", "MI300X")}
    assert ceilings["H20"] > ceilings["A100-80G"] > ceilings["H100-80G"] > ceilings["B200"] > ceilings["MI300X"]
    assert DEVICES["H100-80G"].matmul_flops("bf16") == pytest.approx(794.2 * TFLOPS, rel=1e-3)
    assert DEVICES["H200"].matmul_fraction == DEVICES["H800"].matmul_fraction == ceilings["H100-80G"]
    assert DEVICES["L40S"].matmul_fraction == 1.0 and DEVICES["CPU"].matmul_fraction == 1.0
    assert parse_device("name=X9,memory_gb=64,bf16_tflops=500,hbm_gbs=2000,link_gbs=200").matmul_fraction == 1.0
    device = parse_device("name=X9,memory_gb=64,bf16_tflops=500,hbm_gbs=2000,link_gbs=200,matmul_fraction=0.8")
    assert device.matmul_flops("bf16") == pytest.approx(400 * TFLOPS)

def test_a_device_from_the_cli_and_its_use_in_a_cluster():
    device = parse_device("name=X9,memory_gb=64,bf16_tflops=500,hbm_gbs=2000,link_gbs=200")
    assert device.memory_bytes == 64 * GIB and device.peak_flops("bf16") == 500 * TFLOPS
    assert device.peak_flops("fp16") == 500 * TFLOPS and device.hbm_bandwidth == 2000 * GB
    cluster = Cluster.parse("2x4xX9", devices={"X9": device}, inter_node_bandwidth=50 * GB)
    assert cluster.num_gpus == 8 and cluster.inter_node_bandwidth == 50 * GB


def test_a_device_from_cluster_yaml(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("devices:\n  - {name: X9, memory_gb: 64, bf16_tflops: 500, hbm_gbs: 2000, link_gbs: 200}\n"
                    "nodes: [{type: X9, gpus: 8, count: 2}]\ninter_node_bandwidth_gbs: 50\n")
    cluster = Cluster.from_yaml(path)
    assert cluster.device_names == ("X9",) and cluster.num_gpus == 16


@pytest.mark.parametrize(("text", "message"), [
    ("name=X9,memory_gb=-64,bf16_tflops=500,hbm_gbs=2000,link_gbs=200", r"memory_gb='-64' must be a positive"),
    ("name=X9,memory_gb=64,bf16_tflops=fast,hbm_gbs=2000,link_gbs=200", r"bf16_tflops='fast' is not a number"),
    ("name=X9,memory_gb=64,bf16_tflops=500,link_gbs=200", r"hbm_gbs is missing"),
    ("name=X9,memory_gb=64,hbm_gbs=2000,link_gbs=200", r"give bf16_tflops or fp16_tflops"),
    ("name=X9,memory=64", r"unknown keys \['memory'\]"),
    ("name=X9,memory_gb=64,bf16_tflops=500,hbm_gbs=2000,link_gbs=200,matmul_fraction=1.2",
     r"matmul_fraction='1.2' must be a fraction in \(0, 1\]"),
])
def test_bad_cli_devices_name_the_field(text, message):
    with pytest.raises(ValueError, match=message):
        parse_device(text)


def test_bad_yaml_devices_name_the_entry_and_field(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("devices:\n  - {name: X9, memory_gb: 64, bf16_tflops: 500, hbm_gbs: 0, link_gbs: 200}\n"
                    "nodes: [{type: X9, gpus: 8}]\n")
    with pytest.raises(ValueError, match=r"devices\[0\]\[X9\].hbm_gbs=0 must be a positive number"):
        Cluster.from_yaml(path)
    path.write_text("nodes: [{type: H100, gpus: 8}]\ninter_node_bandwidth_gbs: fast\n")
    with pytest.raises(ValueError, match=r"inter_node_bandwidth_gbs='fast' must be a positive number"):
        Cluster.from_yaml(path)


def test_plan_cli_takes_devices_lengths_and_the_step_recipe(capsys):
    code = main(["plan", "--cluster", "8xX9", "--device", "name=X9,memory_gb=80,bf16_tflops=400,hbm_gbs=3000,"
                 "link_gbs=300", "--algorithm", "grpo", "--model", "qwen3-30b-a3b", "--batch-size", "64",
                 "--response-len", "1024", "--max-response-len", "8192", "--mini-batch-size", "64",
                 "--offload", "actor=params+optimizer", "--rollout-sleep", "--gpu-memory-utilization", "0.6",
                 "--inter-node-gbs", "50", "--json"])
    assert code == 0
    assert '"device": "X9"' in capsys.readouterr().out


@pytest.mark.parametrize(("flags", "message"), [
    (["--device", "name=X9,memory_gb=80,bf16_tflops=0,hbm_gbs=3000,link_gbs=300"], r"bf16_tflops='0' must be"),
    (["--inter-node-gbs", "-5"], r"--inter-node-gbs=-5.0 must be a finite number > 0"),
    (["--max-response-len", "10"], r"max_response_len=10 is below the mean"),
    (["--offload", "actor"], r"--offload 'actor': write ROLE=PARTS"),
    (["--gpu-memory-utilization", "2"], r"--gpu-memory-utilization=2.0 must be a finite number in \(0, 1\]"),
])
def test_bad_plan_flags_exit_with_the_field_named(flags, message, capsys):
    code = main(["plan", "--cluster", "8xH100", "--model", "qwen2.5-7b", *flags])
    assert code == 2
    assert re.search(message, capsys.readouterr().err)


def test_plan_config_yaml_takes_devices_offload_and_lengths(tmp_path, capsys):
    config = tmp_path / "plan.yaml"
    config.write_text("cluster: 8xX9\nalgorithm: grpo\nmodels: {'*': qwen2.5-7b}\nbatch_size: 32\n"
                      "response_len: 1024\nmax_response_len: 8192\nrollout_sleep: true\n"
                      "offload: {actor: [params, optimizer]}\n"
                      "devices: [{name: X9, memory_gb: 80, bf16_tflops: 400, hbm_gbs: 3000, link_gbs: 300}]\n")
    assert main(["plan", "--config", str(config), "--json"]) == 0
    assert '"device": "X9"' in capsys.readouterr().out
    config.write_text("cluster: 8xH100\nmodels: {'*': qwen2.5-7b}\noffload: {actor: [weights]}\n")
    assert main(["plan", "--config", str(config)]) == 2
    assert "offload.actor: unknown part 'weights'" in capsys.readouterr().err
