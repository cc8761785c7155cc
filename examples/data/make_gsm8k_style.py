"""Write a small synthetic GSM8K-style dataset in verl's RL parquet format.

    python examples/data/make_gsm8k_style.py [OUT_DIR]     # default: configs/data/gsm8k_style

The default is where the shipped copy lives: package data of ``hybridflow.configs``, which
``hybridflow init --template grpo_gsm8k_style`` copies next to the config it writes.

Each row is what verl's ``examples/data_preprocess/gsm8k.py`` writes: ``data_source``, ``prompt`` (chat
messages asking for the answer after ``####``), ``ability``, ``reward_model.ground_truth`` and
``extra_info`` (split, index, the worked solution). The problems are generated arithmetic word
problems, seeded, so the files are the same on every machine; train and test use different seeds.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
DATA_SOURCE = "gsm8k_style"
NAMES = ("Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonah")
ITEMS = ("apples", "stickers", "marbles", "books", "pencils", "cookies", "shells", "stamps")

SHIPPED = Path(__file__).resolve().parents[2] / "configs" / "data" / "gsm8k_style"  # the package data's copy
Problem = tuple[str, str, int]  # question, worked solution, answer


def _buy_and_give(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    start, bought, given = rng.randint(5, 40), rng.randint(2, 20), rng.randint(1, 10)
    answer = start + bought - given
    question = f"{name} has {start} {item}. {name} buys {bought} more and gives {given} to a friend. " \
               f"How many {item} does {name} have now?"
    return question, f"{start} + {bought} - {given} = {answer}", answer


def _packs(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    packs, per_pack = rng.randint(2, 9), rng.randint(3, 12)
    answer = packs * per_pack
    question = f"{name} buys {packs} packs of {item} with {per_pack} {item} in each pack. How many {item} is that?"
    return question, f"{packs} * {per_pack} = {answer}", answer


def _share(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each = rng.randint(2, 8), rng.randint(2, 9)
    total = friends * each
    question = f"{name} shares {total} {item} equally among {friends} friends. How many {item} does each friend get?"
    return question, f"{total} / {friends} = {each}", each


def _wage(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    rate, hours, days = rng.randint(8, 25), rng.randint(2, 8), rng.randint(2, 6)
    daily, answer = rate * hours, rate * hours * days
    question = f"{name} earns ${rate} an hour and works {hours} hours a day for {days} days. " \
               f"How many dollars does {name} earn?"
    return question, f"{rate} * {hours} = {daily} per day; {daily} * {days} = {answer}", answer


def _change(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count, price = rng.randint(2, 6), rng.randint(2, 9)
    paid = (count * price // 10 + 1) * 10
    answer = paid - count * price
    question = f"{name} buys {count} {item} at ${price} each and pays with ${paid}. How much change, in dollars, " \
               f"does {name} get?"
    return question, f"{count} * {price} = {count * price}; {paid} - {count * price} = {answer}", answer


def _ages(rng: random.Random) -> Problem:
    older, younger = rng.sample(NAMES, 2)
    age, gap, years = rng.randint(5, 15), rng.randint(2, 10), rng.randint(1, 10)
    answer = age + gap + years
    question = f"{younger} is {age} years old. {older} is {gap} years older than {younger}. " \
               f"How old will {older} be in {years} years?"
    return question, f"{age} + {gap} = {age + gap}; {age + gap} + {years} = {answer}", answer


TEMPLATES: tuple[Callable[[random.Random], Problem], ...] = (_buy_and_give, _packs, _share, _wage, _change, _ages)


def make_rows(count: int, *, split: str, seed: int) -> list[dict[str, Any]]:
    """``count`` rows in verl's RL format, reproducible from ``seed``."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        question, steps, answer = rng.choice(TEMPLATES)(rng)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"split": split, "index": index, "question": question, "answer": f"{steps}\n#### {answer}"},
        })
    return rows


def write(out_dir: Path, *, train: int = 48, test: int = 16) -> list[Path]:
    """``train.parquet`` and ``test.parquet`` under ``out_dir``; returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for split, count, seed in (("train", train, 0), ("test", test, 1)):
        path = out_dir / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(make_rows(count, split=split, seed=seed)), path)
        written.append(path)
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else SHIPPED
    for path in write(target):
        print(f"wrote {path}")
