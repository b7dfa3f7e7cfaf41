"""Fixtures of the learner tests."""

from __future__ import annotations

import random

import pytest
from learner_fixtures import make_group

from learner.types import RolloutGroup


@pytest.fixture
def rng() -> random.Random:
    return random.Random(1234)


@pytest.fixture
def groups(rng: random.Random) -> list[RolloutGroup]:
    return [
        make_group(rng, [1.0, 0.0, 0.5, 0.0], group_id="a"),
        make_group(rng, [0.2, 0.9, 0.9], group_id="b"),
        make_group(rng, [0.3, 0.3, 0.3], group_id="all-equal"),
    ]
