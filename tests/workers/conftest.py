"""Worker tests: one torch thread (the gloo group ``process_group`` lives in tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny models on a shared 2-core machine: one thread avoids oversubscription (10x faster here)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
