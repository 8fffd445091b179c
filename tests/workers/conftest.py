"""Worker tests: one torch thread (``one_torch_thread`` and the gloo group ``process_group`` live in
tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield
