"""Shared fixtures for the algorithm tests: a tiny linear policy (no model needed)."""

import pytest
from algorithms_testing import TinyPolicy, make_tiny_policy


@pytest.fixture
def tiny_policy() -> TinyPolicy:
    return make_tiny_policy()
