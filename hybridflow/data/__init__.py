"""Prompts (files, chat templates, splits), preference pairs, built-in tasks, reward functions, offline tokenizer."""

from hybridflow.data import visual_tasks  # noqa: F401 (registers the vision tasks)
from hybridflow.data.dataset import PromptLoader, encode_prompts, load_records
from hybridflow.data.math_reward import answers_equivalent, extract_answer, math_reward
from hybridflow.data.preference import (
    PreferenceLoader,
    encode_pairs,
    load_preference_records,
    preference_task_examples,
)
from hybridflow.data.prompts import PreparedRecords, prepare_records
from hybridflow.data.records import GroundTruth, Record, render_prompt
from hybridflow.data.reward_functions import RewardFunction, RewardSignatureError, Sample, reward_function
from hybridflow.data.reward_specs import REWARDS, load_reward_functions
from hybridflow.data.rewards import (
    RewardScorer,
    RuleScorer,
    batch_samples,
    decode_responses,
    reward_scorer,
)
from hybridflow.data.splits import DataSpec, DataSplits, hold_out, load_splits
from hybridflow.data.tasks import TASKS, Task, char_accuracy, task_examples
from hybridflow.models.tokenizer import char_tokenizer, load_tokenizer

__all__ = ["REWARDS", "TASKS", "DataSpec", "DataSplits", "GroundTruth", "PreferenceLoader", "PreparedRecords",
           "PromptLoader", "Record", "RewardFunction", "RewardScorer", "RewardSignatureError", "RuleScorer", "Sample",
           "Task", "answers_equivalent", "batch_samples", "char_accuracy", "char_tokenizer", "decode_responses",
           "encode_pairs", "encode_prompts", "extract_answer", "hold_out", "load_preference_records", "load_records",
           "load_reward_functions", "load_splits", "load_tokenizer", "math_reward", "preference_task_examples",
           "prepare_records", "render_prompt", "reward_function", "reward_scorer", "task_examples"]
