"""The largest_colour task: its answer is what the image shows, its records are what the data loaders read."""

from __future__ import annotations

import collections

import pytest

from hybridflow.data import TASKS, prepare_records, task_examples
from hybridflow.data.images import ImageRef, open_image
from hybridflow.data.preference import preference_task_examples
from hybridflow.data.visual_tasks import BACKGROUND, COLOURS
from hybridflow.models.vision import tiny_vlm_processor


def test_the_answer_is_the_colour_covering_most_of_the_image() -> None:
    records = task_examples("largest_colour", 40, seed=3)
    assert {r["ground_truth"] for r in records} == set(COLOURS)  # every answer occurs
    assert task_examples("largest_colour", 40, seed=3)[5]["images"][0].source == records[5]["images"][0].source
    for record in records:
        (ref,) = record["images"]
        assert isinstance(ref, ImageRef) and record["prompt"][0]["content"][0] == {"type": "image"}
        counts = collections.Counter(open_image(ref).convert("RGB").getdata())
        counts.pop(BACKGROUND, None)
        assert counts.most_common(1)[0][0] == COLOURS[record["ground_truth"]]
    rule = TASKS.get("largest_colour").reward
    assert (rule(" red ", "red"), rule("re", "red"), rule("blue", "red")) == (1.0, 0.0, 0.0)


def test_its_records_prepare_with_their_visual_tokens_counted() -> None:
    processor = tiny_vlm_processor()
    prepared = prepare_records(task_examples("largest_colour", 4), processor.tokenizer, processor=processor)
    assert prepared.image_tokens == 4  # 16 x 16 px: one visual token per 8 x 8
    text = len(processor.tokenizer(prepared.records[0]["prompt"], add_special_tokens=False).input_ids)
    assert prepared.longest_prompt_tokens == text - 1 + 4  # the placeholder becomes the 4 tokens


def test_rule_built_preference_pairs_refuse_a_vision_task() -> None:
    with pytest.raises(ValueError, match=r"largest_colour.*pairs in a data file"):
        preference_task_examples("largest_colour", 2)
