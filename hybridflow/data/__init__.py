"""Prompts, built-in verifiable tasks, rule rewards and the offline character tokenizer."""

from hybridflow.data.dataset import PromptLoader, encode_prompts, load_records
from hybridflow.data.rewards import RuleScorer, decode_responses
from hybridflow.data.tasks import TASKS, Task, char_accuracy, task_examples
from hybridflow.data.tokenizer import char_tokenizer, load_tokenizer

__all__ = ["TASKS", "PromptLoader", "RuleScorer", "Task", "char_accuracy", "char_tokenizer", "decode_responses",
           "encode_prompts", "load_records", "load_tokenizer", "task_examples"]
