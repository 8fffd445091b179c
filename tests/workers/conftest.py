"""Worker tests: a single-process gloo group (rank 0 of 1) for the whole session, one torch thread."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def process_group():
    """torch.distributed initialised as rank 0 of 1 (gloo), as the workers require."""
    import torch.distributed as dist

    from easyvlm.workers.dist import init_distributed

    if not dist.is_initialized():
        init_distributed("gloo")
    assert dist.get_world_size() == 1
    return dist.group.WORLD


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny models on a shared 2-core machine: one thread avoids oversubscription (10x faster here)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
