"""The dialect engine (:mod:`hybridflow.train.dialects`): TRL's and verl's tables keep at least the rows of each
kind they had when they became data, and a row added to a dialect is read with no other edit."""

from __future__ import annotations

import pytest

from hybridflow.train.config import TrainConfig
from hybridflow.train.config_keys import walk
from hybridflow.train.dialect_trl import TRL
from hybridflow.train.dialect_verl import VERL
from hybridflow.train.dialects import Dialect, translate
from hybridflow.train.foreign_keys import accepted, refused, renamed, translated


def test_a_refusal_at_every_value_must_say_why() -> None:
    with pytest.raises(ValueError, match="must say why"):
        refused("x", "", unless=())


# Rows of each kind on the day the dialects became data (issue 38 item 4): a floor, so that a refactor of a table
# never quietly drops keys; raise a number when rows are added.
FLOORS = {
    "TRL": {"renamed": 15, "translated": 30, "accepted": 80, "accepted when off": 52, "accepted at values": 10,
            "refused": 0},
    "verl": {"renamed": 33, "translated": 44, "accepted": 140, "accepted when off": 102, "accepted at values": 27,
             "refused": 1},
}


@pytest.mark.parametrize("dialect", [TRL, VERL], ids=["TRL", "verl"])
def test_the_dialects_keep_at_least_their_rows_of_each_kind(dialect: Dialect) -> None:
    counts = dialect.counts()
    assert sum(counts.values()) == len(dialect.rows) >= {"TRL": 187, "verl": 347}[dialect.name]
    short = {kind: (counts[kind], floor) for kind, floor in FLOORS[dialect.name].items() if counts[kind] < floor}
    assert not short, f"{dialect.name} rows of each kind (now, floor): {short}"
    assert all(row.source == dialect.name for row in dialect.rows.values())


def _native(key: str) -> bool:
    return walk(TrainConfig, key)[0] != "unknown"


def test_a_new_row_is_translated_by_the_engine_with_no_other_edit() -> None:
    """One row added to a dialect built here, and to a copy of verl's: the engine finds, translates, accepts and
    refuses by it, with no code beside the row."""
    toy = Dialect(name="toy", title="a toy trainer's config", match="pattern", rows={
        "optim.learning_rate": renamed("optim.actor.lr", "the learning rate"),
        "optim.warm": translated(lambda value, context: {"optim.actor.warmup_steps": 2 * value}, "half warmup steps",
                                 "optim.actor.warmup_steps = 2 x this"),
        "logs.**": accepted("logging options", "what the console shows"),
        "fancy": refused("a feature we lack", "not supported"),
    })
    problems: list[str] = []
    pairs = [("optim.learning_rate", 0.1), ("warm", 3), ("logs.colour", "red"), ("fancy", False), ("steps", 2)]
    assert translate(pairs, [toy], _native, problems, str) == [("steps", 2), ("optim.actor.lr", 0.1),
                                                                ("optim.actor.warmup_steps", 6)]
    assert not problems
    translate([("fancy", True), ("nope", 1)], [toy], _native, problems, lambda key: f"unknown {key}")
    assert problems == ["unknown nope", "'fancy' (toy: a feature we lack)=True: not supported (docs/migrating.md)"]

    grown = Dialect(name="verl", title=VERL.title, match="pattern",
                    rows={**VERL.rows, "trainer.new_steps": renamed("steps", "a key verl adds")})
    assert translate([("trainer.new_steps", 7)], [TRL, grown], _native, [], str) == [("steps", 7)]
    assert grown.counts()["renamed"] == VERL.counts()["renamed"] + 1
    assert grown.rows["trainer.new_steps"].source == "verl"


def test_an_exact_dialect_matches_only_whole_names() -> None:
    """TRL's fields match by their own name only; a pattern row needs ``match='pattern'``."""
    assert TRL.find("beta") is not None and TRL.find("x.beta") is None and TRL.sections() == frozenset()
    with pytest.raises(ValueError, match="match='pattern'"):
        Dialect(name="toy", title="toy", rows={"logs.**": accepted("logging options", "the console's")})
