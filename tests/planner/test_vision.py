"""Vision-language models in the planner: the Qwen2.5-VL catalogue, visual tokens in the workload, the tower's
FLOPs, memory and seconds on the roles that read images, and ``hybridflow plan --image-tokens``."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hybridflow.cli import main
from hybridflow.graph import NodeLoad, Op, RoleKind, Workload, load_graph, node_loads
from hybridflow.planner import Cluster, ModelSpec, PlanRequest, RoleLayout, Sharding, plan_placement
from hybridflow.planner.calibration import Constants
from hybridflow.planner.costs import Shape, batching, forward_cost, state_bytes, update_cost, vision_seconds
from hybridflow.planner.devices import GB, GIB, TFLOPS, DeviceSpec
from hybridflow.planner.flops import flops_per_token, vision_flops_per_token
from hybridflow.planner.models import from_config_dict
from hybridflow.planner.problem import build_problem
from hybridflow.planner.rollout import Engine, generate_cost
from hybridflow.planner.settings import RunSettings
from hybridflow.planner.vision import VisionSpec
from hybridflow.planner.weight_moves import sync_payload

ROUND = DeviceSpec(name="ROUND", memory_bytes=100 * GIB, hbm_bandwidth=1000 * GB, flops=(("bf16", 100 * TFLOPS),),
                   link="NVLink", link_bandwidth=100 * GB, host_bandwidth=10 * GB)
PLAIN = Constants(train_mfu=0.5, eff_half_tokens=1000, hbm_efficiency=0.5, decode_mfu=0.5, prefill_mfu=0.5,
                  host_efficiency=0.5, decode_step_overhead_s=0.0, phase_overhead_s=0.0)
VL7B = ModelSpec.preset("qwen2.5-vl-7b")
ROWS, TEXT, IMAGE, RESPONSE = 64, 256, 1024, 512
# Qwen/Qwen2.5-VL-7B-Instruct's config.json as transformers >= 4.53 saves it: text keys top-level and in text_config.
VL7B_CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_size": 3584,
    "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "vocab_size": 152064, "tie_word_embeddings": False,
    "text_config": {"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
                    "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064},
    "vision_config": {"depth": 32, "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu",
                      "hidden_size": 1280, "in_channels": 3, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
                      "temporal_patch_size": 2, "window_size": 112}}


def shape(gpus: int = 1) -> Shape:
    return Shape(ROUND, (gpus,), 25e9, run=RunSettings(), constants=PLAIN)


def load(op: Op, image: int = IMAGE) -> NodeLoad:
    return NodeLoad("n", op, ROWS, ROWS * (TEXT + image), ROWS * RESPONSE, ROWS * image, image)


def test_qwen2_5_vl_presets_match_their_published_sizes():
    # Model cards: 3.75B, 8.29B, 33.5B and 73.4B weights, language model and tower together.
    for name, total in (("qwen2.5-vl-3b", 3.75e9), ("qwen2.5-vl-7b", 8.29e9), ("qwen2.5-vl-32b", 33.5e9),
                        ("qwen2.5-vl-72b", 73.4e9)):
        model = ModelSpec.preset(name)
        assert model.vision is not None and model.vision.out_hidden == model.hidden
        assert model.params + model.vision_params == pytest.approx(total, rel=0.01), name
    assert VL7B.vision_params == pytest.approx(0.676e9, rel=0.01)  # the ~675M ViT of the Qwen2.5-VL report
    # The language model is the Qwen2.5 of that size.
    assert dataclasses.replace(VL7B, vision=None, name="qwen2.5-7b") == ModelSpec.preset("qwen2.5-7b")
    assert ModelSpec.preset("qwen2.5-7b").vision is None


def test_a_vision_language_config_json_reads_as_the_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(VL7B_CONFIG))
    model = ModelSpec.from_hf_config(tmp_path)
    assert model.vision == VL7B.vision and model.params == VL7B.params and model.layers == 28
    # Qwen2-VL names its tower's width embed_dim (hidden_size is the LM's there) and has no windows.
    qwen2_vl = from_config_dict({**VL7B_CONFIG, "vision_config": {"depth": 32, "embed_dim": 1280, "hidden_size": 3584,
                                                                   "num_heads": 16, "mlp_ratio": 4,
                                                                   "spatial_merge_size": 2}}, name="qwen2-vl")
    assert qwen2_vl.vision is not None and qwen2_vl.vision.hidden == 1280 and qwen2_vl.vision.window_size == 0
    with pytest.raises(ValueError, match="vision_config lacks"):
        from_config_dict({**VL7B_CONFIG, "vision_config": {"hidden_size": 1280}}, name="broken")


def test_images_enter_the_prompt_of_roles_whose_model_has_a_tower_only():
    graph = load_graph("ppo")
    workload = Workload(batch_size=8, prompt_len=TEXT, response_len=RESPONSE, n_samples=1, image_tokens=IMAGE)
    text = ModelSpec.preset("qwen2.5-7b")
    problem = build_problem(graph, {"actor": VL7B, "reference": VL7B, "critic": VL7B, "reward": text}, workload,
                            Cluster.parse("8xA100-80G"))
    actor, reward = problem.role("actor"), problem.role("reward")
    assert actor.generate[0].prompt_tokens == 8 * (TEXT + IMAGE) and actor.generate[0].image_tokens == 8 * IMAGE
    assert all(item.row_image_tokens == IMAGE for item in actor.forward + actor.update)
    assert reward.forward[0].prompt_tokens == 8 * TEXT and reward.forward[0].image_tokens == 0
    # Without images nothing changes: the loads are the text workload's.
    plain = Workload(batch_size=8, prompt_len=TEXT, response_len=RESPONSE, n_samples=1)
    assert node_loads(graph, dataclasses.replace(workload, image_tokens=0)) == node_loads(graph, plain)
    with pytest.raises(ValueError, match="image_tokens"):
        Workload(batch_size=8, prompt_len=TEXT, response_len=RESPONSE, image_tokens=-1)


def test_tower_flops_count_patches_windows_and_the_merger():
    tower = VL7B.vision
    assert tower is not None
    forward = vision_flops_per_token(tower, IMAGE, 1)
    # 4 patches a token through the blocks' ~630M weights dominate: ~5.5 GFLOPs, 40% of a 7B LM's token.
    assert 5.0e9 < forward < 6.0e9
    assert 0.3 < forward / flops_per_token(VL7B, TEXT + IMAGE, 1, head=False) < 0.5
    # Full attention in every block costs more once the image outgrows a window; below a window it is the same.
    unwindowed = dataclasses.replace(tower, window_size=0, full_attention_blocks=0)
    assert vision_flops_per_token(unwindowed, 4096, 1) > 1.3 * vision_flops_per_token(tower, 4096, 1)
    assert vision_flops_per_token(unwindowed, 16, 1) == pytest.approx(vision_flops_per_token(tower, 16, 1))
    assert vision_flops_per_token(tower, IMAGE, 3) == pytest.approx(3 * forward, rel=0.05)


def test_every_pass_of_a_vision_role_pays_for_its_images():
    layout = RoleLayout(role="actor", dp=1, micro_batch_size=4)
    text_only = forward_cost(VL7B, RoleKind.POLICY, load(Op.LOGPROB, image=0), layout, shape()).seconds
    with_images = forward_cost(VL7B, RoleKind.POLICY, load(Op.LOGPROB), layout, shape()).seconds
    batch = batching(load(Op.LOGPROB), layout, shape(), train=False)
    tower = vision_seconds(VL7B, load(Op.LOGPROB), batch, layout, shape(), 1)
    # 1,792 tokens a row instead of 768 (the prompt's 1,024 visual tokens) and the tower beside them.
    assert tower > 0 and with_images > 2 * text_only and with_images > text_only + tower
    # The same images on a text-only model cost nothing (its loads never carry them: problem.py strips them).
    text = dataclasses.replace(VL7B, vision=None)
    assert vision_seconds(text, load(Op.LOGPROB), batch, layout, shape(), 1) == 0.0
    rollout = RoleLayout(role="actor", dp=1, micro_batch_size=4, rollout_tp=1)
    generate = NodeLoad("g", Op.GENERATE, ROWS, 16 * (TEXT + IMAGE), ROWS * RESPONSE, 16 * IMAGE, IMAGE)
    bare = dataclasses.replace(generate, prompt_tokens=16 * TEXT, image_tokens=0, row_image_tokens=0)
    assert generate_cost(VL7B, generate, TEXT, rollout, shape()).seconds > generate_cost(VL7B, bare, TEXT, rollout,
                                                                                         shape()).seconds


def test_a_frozen_tower_runs_forward_only_in_an_update_and_holds_no_optimizer_state():
    layout = RoleLayout(role="actor", dp=8, sharding=Sharding.FULL_SHARD, micro_batch_size=4)
    trained = dataclasses.replace(VL7B, vision=VL7B.vision.with_trainable(True))
    batch = batching(load(Op.UPDATE), layout, shape(8), train=True)
    frozen_s = vision_seconds(VL7B, load(Op.UPDATE), batch, layout, shape(8), 3)
    assert frozen_s == pytest.approx(vision_seconds(VL7B, load(Op.UPDATE), batch, layout, shape(8), 1))
    assert vision_seconds(trained, load(Op.UPDATE), batch, layout, shape(8), 3) > 2.5 * frozen_s
    text = dataclasses.replace(VL7B, vision=None)
    frozen_state = state_bytes(VL7B, RoleKind.POLICY, layout, shape(8))
    weights, grads, states = (a - b for a, b in zip(frozen_state, state_bytes(text, RoleKind.POLICY, layout, shape(8)),
                                                      strict=True))
    assert weights == pytest.approx(VL7B.vision_params * 2 / 8) and grads == 0 and states == 0
    _, grads, states = state_bytes(trained, RoleKind.POLICY, layout, shape(8))
    _, text_grads, text_states = state_bytes(text, RoleKind.POLICY, layout, shape(8))
    assert states - text_states == pytest.approx(VL7B.vision_params * 12 / 8)
    assert grads - text_grads == pytest.approx(VL7B.vision_params * 2 / 8)
    assert update_cost(trained, RoleKind.POLICY, load(Op.UPDATE), layout, shape(8)).seconds > update_cost(
        VL7B, RoleKind.POLICY, load(Op.UPDATE), layout, shape(8)).seconds
    # The engine holds the tower; an update sends it only when it trains.
    assert Engine(VL7B, shape(), 1, 2).weights == pytest.approx((VL7B.params + VL7B.vision_params) * 2)
    assert sync_payload(VL7B, layout)[0] == VL7B.params * 2
    assert sync_payload(trained, layout)[0] == (VL7B.params + VL7B.vision_params) * 2


def test_a_geo3k_plan_reports_where_the_tower_spends_its_time():
    graph = load_graph("grpo", reward_kind="reward_function")
    cluster = Cluster.parse("8xA100-80G")

    def plan(image: int, model: ModelSpec = VL7B):
        workload = Workload(batch_size=512, prompt_len=TEXT, response_len=RESPONSE, n_samples=5, image_tokens=image)
        return plan_placement(PlanRequest(graph, dict.fromkeys(("actor", "reference"), model), workload, cluster))

    text, small, geo3k = plan(0), plan(256), plan(IMAGE)
    assert "vision" not in dict(text.extra)
    share = dict(geo3k.extra)["vision_share"]
    assert 0.02 < share < 0.5 and share > dict(small.extra)["vision_share"]
    assert geo3k.step_time_s > 1.5 * text.step_time_s  # a prompt of 1,280 tokens instead of 256
    # A text-only model's plan is the same with or without the flag's images (none reach it).
    qwen = ModelSpec.preset("qwen2.5-7b")
    assert plan(IMAGE, qwen).step_time_s == pytest.approx(plan(0, qwen).step_time_s)


def test_plan_cli_takes_image_tokens_and_names_the_flag_when_no_model_sees(capsys):
    args = ["plan", "--algorithm", "grpo", "--reward-kind", "reward_function", "--cluster", "8xA100-80G",
            "--batch-size", "128", "--prompt-len", "256", "--response-len", "512", "--n-samples", "5"]
    assert main([*args, "--model", "qwen2.5-vl-7b", "--image-tokens", "1024", "--json"]) == 0
    extra = dict(json.loads(capsys.readouterr().out)["extra"])
    assert 0 < extra["vision_share"] < 1 and "actor_update" in extra["vision"]
    assert main([*args, "--model", "qwen2.5-vl-7b", "--image-tokens", "1024"]) == 0
    assert "vision tower:" in capsys.readouterr().out
    assert main([*args, "--model", "qwen2.5-7b", "--image-tokens", "1024"]) != 0
    assert "--image-tokens=1024: no role's model has a vision tower" in capsys.readouterr().err
    assert main([*args, "--model", "qwen2.5-vl-7b", "--image-tokens", "-3"]) != 0
    assert "--image-tokens=-3 must be at least 0" in capsys.readouterr().err


def test_vision_spec_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"VisionSpec.depth=0"):
        VisionSpec(depth=0, hidden=8, heads=2, intermediate=16, out_hidden=8)
    with pytest.raises(ValueError, match="full_attention_blocks=3 exceeds depth=2"):
        VisionSpec(depth=2, hidden=8, heads=2, intermediate=16, out_hidden=8, window_size=4, full_attention_blocks=3)


def test_tower_weights_and_flops_match_transformers_qwen2_5_vl_tower():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from torch.utils.flop_counter import FlopCounterMode
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen

    config = qwen.Qwen2_5_VLVisionConfig(depth=4, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=48,
                                         patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                                         window_size=112, fullatt_block_indexes=[1])
    config._attn_implementation = "eager"  # attention as matmuls the counter sees (CPU sdpa kernels it does not)
    tower = qwen.Qwen2_5_VisionTransformerPretrainedModel._from_config(config).eval()
    spec = VisionSpec(depth=4, hidden=64, heads=4, intermediate=96, out_hidden=48, window_size=112,
                      full_attention_blocks=1)
    assert spec.params == sum(weight.numel() for weight in tower.parameters())
    # A 32 x 48-patch image (384 visual tokens: 24 windows, one full-attention block) and one smaller than a window.
    for grid in ((1, 32, 48), (1, 8, 8)):
        thw = torch.tensor([grid])
        pixels = torch.randn(int(thw.prod()), spec.patch_inputs)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            tower(pixels, grid_thw=thw)
        tokens = int(thw.prod()) // spec.patches_per_token
        assert vision_flops_per_token(spec, tokens, 1) * tokens == pytest.approx(counter.get_total_flops(), rel=1e-9)
