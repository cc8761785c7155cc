"""Prompt images (issue 41, item 1): verl's and TRL's formats, local files, resizing by the model's processor,
bad images named by row and column or skipped and counted, and the batch's per-row image inputs."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from data_files import png_bytes, png_header_claiming, write_jsonl, write_parquet
from PIL import Image

from hybridflow.data import load_records, prepare_records
from hybridflow.data.dataset import PromptLoader
from hybridflow.data.images import IMAGE_PART, BadImageError, ImageRef, open_image
from hybridflow.data.vision_prompts import encode_vision_prompts, image_tokens
from hybridflow.models.vision import IMAGE_PAD, load_processor, save_vlm_dir, tiny_vlm_processor

RED, BLUE = (255, 0, 0), (0, 0, 255)


@pytest.fixture(scope="module")
def processor() -> Any:
    return tiny_vlm_processor()


def _verl_row(images: list[Any], text: str, answer: str) -> dict[str, Any]:
    return {"data_source": "geo3k", "images": images, "prompt": [{"role": "user", "content": text}],
            "reward_model": {"style": "rule", "ground_truth": answer}}


def test_verl_parquet_rows_with_image_bytes_and_placeholders(tmp_path: Path, processor: Any) -> None:
    rows = [_verl_row([{"bytes": png_bytes((32, 16), RED), "path": None}], "<image>Which colour?", "red"),
            _verl_row([{"bytes": png_bytes((16, 16), BLUE), "path": None}, {"bytes": png_bytes((8, 24)), "path": None}],
                      "Compare <image> with <image>.", "no")]
    records = load_records(write_parquet(tmp_path / "geo.parquet", rows))
    assert records[0]["prompt"] == [{"role": "user",
                                     "content": [IMAGE_PART, {"type": "text", "text": "Which colour?"}]}]
    assert records[1]["prompt"][0]["content"] == [{"type": "text", "text": "Compare "}, IMAGE_PART,
                                                  {"type": "text", "text": " with "}, IMAGE_PART,
                                                  {"type": "text", "text": "."}]
    assert records[1]["ground_truth"] == "no" and records[1]["data_source"] == "geo3k"
    assert [ref.column for ref in records[1]["images"]] == ["images", "images"]

    prepared = prepare_records(records, processor.tokenizer, processor=processor)
    batch = encode_vision_prompts(prepared.records, processor)
    pad_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    for row in range(2):
        grids, pixels = batch["image_grid_thw"][row], batch["pixel_values"][row]
        assert pixels.shape[0] == int(grids.prod(axis=1).sum()) and pixels.dtype == np.float32
        # Each image's placeholder became one token per 2 x 2 merged patches.
        assert int((batch["prompts"][row] == pad_id).sum()) == int(grids.prod(axis=1).sum()) // 4
    assert [len(g) for g in batch["image_grid_thw"]] == [1, 2]
    # The prompt length counted the visual tokens: the longest prompt is the batch's width (left padding).
    assert prepared.longest_prompt_tokens == batch["prompts"].shape[1]
    assert int(batch["prompt_mask"].sum(1).max()) == prepared.longest_prompt_tokens


def test_trl_image_column_with_content_parts_and_local_files(tmp_path: Path, processor: Any) -> None:
    Image.new("RGB", (24, 24), RED).save(tmp_path / "red.png")
    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (24, 24), BLUE).save(tmp_path / "imgs" / "blue.png")
    parts = [{"type": "image"}, {"type": "text", "text": "What colour?"}]
    rows = [{"image": "red.png", "prompt": [{"role": "user", "content": parts}], "solution": "red"},
            # No placeholder: TRL puts the images at the start of the first user turn.
            {"images": [str(tmp_path / "imgs" / "blue.png")],
             "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Colour?"}],
             "solution": "blue"}]
    records = load_records(write_jsonl(tmp_path / "data.jsonl", rows), answer_key="solution")
    assert records[0]["images"][0].source == str(tmp_path / "red.png")  # relative: from the data file's folder
    assert records[1]["prompt"][1]["content"][0] == IMAGE_PART and records[1]["prompt"][0]["content"] == [
        {"type": "text", "text": "Be brief."}]
    batch = PromptLoader(records=prepare_records(records, processor.tokenizer, processor=processor).records,
                         tokenizer=processor.tokenizer, batch_size=2, processor=processor).encode(records)
    # The decoded colours reach the pixel values: the red and the blue image differ.
    assert not np.allclose(batch["pixel_values"][0], batch["pixel_values"][1])


def test_text_only_rows_keep_their_path(tmp_path: Path) -> None:
    records = load_records(write_jsonl(tmp_path / "t.jsonl", [{"prompt": "1+1?", "ground_truth": "2"}]))
    assert records == [{"prompt": "1+1?", "ground_truth": "2"}]


def test_a_placeholder_count_that_differs_from_the_images_names_the_row(tmp_path: Path) -> None:
    rows = [_verl_row([{"bytes": png_bytes((8, 8))}], "<image> and <image>?", "x")]
    with pytest.raises(ValueError, match=r"row 1: the prompt has 2 image placeholders .* the row has 1 images"):
        load_records(write_parquet(tmp_path / "d.parquet", rows))


BAD = {
    "corrupt bytes": (b"\x89PNG\r\n\x1a\n not an image", "not a readable image"),
    "empty bytes": (b"", "empty bytes"),
    "missing file": ("nowhere/missing.png", "no image file"),
    "20k x 20k": (png_header_claiming(20_000, 20_000), "too large to decode"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_image_is_named_by_row_and_column(tmp_path: Path, processor: Any, case: str) -> None:
    image, reason = BAD[case]
    if isinstance(image, str):  # paths in a jsonl file
        (tmp_path / "ok.png").write_bytes(png_bytes((8, 8)))
        rows = [{"prompt": "<image>ok", "ground_truth": "a", "image": "ok.png"},
                {"prompt": "<image>bad", "ground_truth": "b", "image": image}]
        records = load_records(write_jsonl(tmp_path / "d.jsonl", rows))
    else:
        rows = [{"prompt": "<image>ok", "ground_truth": "a", "image": png_bytes((8, 8))},
                {"prompt": "<image>bad", "ground_truth": "b", "image": image}]
        records = load_records(write_parquet(tmp_path / "d.parquet", rows))
    with pytest.raises(BadImageError, match=rf"(line|row) 2, column 'image' image 0: {reason}.*bad_images=skip"):
        prepare_records(records, processor.tokenizer, processor=processor)


def test_a_zero_size_image_is_refused() -> None:
    ref = ImageRef(Image.new("RGB", (0, 0)), "d.jsonl line 4", "images", 1)
    with pytest.raises(BadImageError, match=r"d.jsonl line 4, column 'images' image 1: zero size \(0 x 0\)"):
        open_image(ref)


def test_the_skip_policy_drops_and_counts_rows_with_bad_images(tmp_path: Path, processor: Any) -> None:
    rows = [{"prompt": "<image>a", "ground_truth": "a", "images": [{"bytes": png_bytes((8, 8))}]},
            {"prompt": "<image>b", "ground_truth": "b", "images": [{"bytes": b"garbage"}]},
            {"prompt": "<image>c", "ground_truth": "c", "images": [{"bytes": png_header_claiming(20_000, 20_000)}]},
            {"prompt": "<image>d", "ground_truth": "d", "images": [{"bytes": png_bytes((16, 8))}]}]
    prepared = prepare_records(load_records(write_parquet(tmp_path / "d.parquet", rows)), processor.tokenizer,
                               processor=processor, bad_images="skip")
    assert prepared.skipped_images == 2 and [r["ground_truth"] for r in prepared.records] == ["a", "d"]
    assert prepared.filtered == 0


def test_images_without_a_processor_are_refused(tmp_path: Path, processor: Any) -> None:
    records = load_records(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "<image>?", "ground_truth": "a",
                                                               "images": [str(tmp_path / "x.png")]}]))
    with pytest.raises(ValueError, match="records have images, but no processor"):
        prepare_records(records, processor.tokenizer)


def test_min_and_max_pixels_bound_the_visual_tokens(tmp_path: Path) -> None:
    from hybridflow.models.vision import build_tiny_vlm

    tokenizer = tiny_vlm_processor().tokenizer
    directory = save_vlm_dir(build_tiny_vlm(tokenizer), tiny_vlm_processor(tokenizer), tmp_path / "vlm")
    big, small = load_processor(directory, max_pixels=32 * 32), load_processor(directory, max_pixels=16 * 16)
    assert image_tokens(big, (64, 64)) == 16 and image_tokens(small, (64, 64)) == 4  # 8 x 8 px a token
    upscaled = load_processor(directory, min_pixels=32 * 32, max_pixels=64 * 64)
    assert image_tokens(upscaled, (8, 8)) == 16
    image = ImageRef(png_bytes((64, 64)), "r", "images", 0)
    batch = encode_vision_prompts([{"prompt": "<|vision_start|><|image_pad|><|vision_end|>?", "ground_truth": "",
                                    "images": [image]}], small)
    assert batch["image_grid_thw"][0].tolist() == [[1, 4, 4]]


def test_the_data_section_owns_the_vision_keys() -> None:
    from hybridflow.train.config import config_from_dotted

    config = config_from_dotted({"data.vision.min_pixels": 64, "data.vision.max_pixels": 1024,
                                 "data.vision.bad_images": "skip"})
    assert (config.data.vision.min_pixels, config.data.vision.max_pixels) == (64, 1024)
    assert config.data.vision.bad_images == "skip"
    with pytest.raises(ValueError, match=r"data\.vision\.min_pixels.*above max_pixels|data\.vision\.max_pixels"):
        config_from_dotted({"data.vision.min_pixels": 4096, "data.vision.max_pixels": 1024})
    with pytest.raises(ValueError, match=r"data\.vision\.bad_images"):
        config_from_dotted({"data.vision.bad_images": "ignore"})


def test_pil_images_in_rows_are_read(processor: Any) -> None:
    ref = ImageRef(Image.new("L", (16, 8), 128), "r", "image", 0)
    assert open_image(ref).mode == "RGB" and open_image(ref).size == (16, 8)
    assert open_image(ImageRef(io.BytesIO(png_bytes((8, 8))).getvalue(), "r", "image", 0)).size == (8, 8)


def test_a_run_reads_its_vision_keys_with_the_policys_processor(tmp_path: Path) -> None:
    from hybridflow.models.vision import build_tiny_vlm
    from hybridflow.train import setup
    from hybridflow.train.config import config_from_dotted

    processor = tiny_vlm_processor()
    model_dir = save_vlm_dir(build_tiny_vlm(processor.tokenizer), processor, tmp_path / "vlm")
    rows = [_verl_row([{"bytes": png_bytes((64, 64), RED)}], "<image>Colour?", "red"),
            _verl_row([{"bytes": b"broken"}], "<image>Colour?", "?"),
            _verl_row([{"bytes": png_bytes((64, 32), BLUE)}], "<image>Colour?", "blue")]
    config = config_from_dotted({"model.path": str(model_dir), "data.path": str(write_parquet(tmp_path / "d.parquet",
                                                                                                rows)),
                                 "data.reward": "math", "data.batch_size": 2, "data.vision.max_pixels": 16 * 16,
                                 "data.vision.bad_images": "skip"})
    tokenizer = setup.policy_tokenizer(config)
    train, _ = setup.prepare_data(config, setup.data_splits(config), tokenizer)
    assert train.skipped_images == 1 and train.kept == 2
    batch = setup.prompt_loader(config, train.records, tokenizer).batch(0)
    # max_pixels=256 resizes 64 x 64 to 16 x 16 and 64 x 32 to 16 x 8 pixels, in 4 px patches (the processor's
    # own bound, 1,024, would give 32 x 32: an 8 x 8 grid).
    assert sorted(grid.tolist() for grid in batch["image_grid_thw"]) == [[[1, 2, 4]], [[1, 4, 4]]]
