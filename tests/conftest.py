"""Shared test setup: offline hub, in-process vLLM, one asset cache per clone, gpu skips.

Session fixtures build the embedded assets once into the cache (``$EASYVLM_CACHE`` if set, else
``<repo>/.cache/easyvlm-test``, which later runs of the same clone reuse).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import easyvlm.builtin

easyvlm.builtin.register()  # what every command does first: builtin: model paths and data sets resolve

REPO_ROOT = Path(__file__).resolve().parents[1]

# Before anything imports huggingface_hub / vllm (they read these at import time).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
# Exported, so code under test that calls materialize_model() without a cache_dir (and any
# subprocess or Ray worker it starts) uses the same cache as the fixtures.
os.environ.setdefault("EASYVLM_CACHE", str(REPO_ROOT / ".cache" / "easyvlm-test"))

# Test-sized synthetic splits: the full default sizes are for training, not for unit tests.
TEST_TRAIN_SIZE = 64
TEST_VAL_SIZE = 32


@pytest.fixture
def one_torch_thread():
    """Tiny models on a shared 2-core machine: one torch thread avoids oversubscription (10x faster
    here). Worker tests take it always (tests/workers/conftest.py), model tests by ``usefixtures``.
    Through ``torch._C``: an in-process vLLM engine replaces ``torch.set_num_threads`` with a no-op
    for the rest of the process (vllm/v1/worker/cpu_worker.py), and forwards after it would run on
    two threads, 10-100x slower on a busy 2-core machine."""
    import torch

    threads = torch._C.get_num_threads()
    torch._C.set_num_threads(1)
    yield
    torch._C.set_num_threads(threads)


@pytest.fixture(scope="session")
def easyvlm_cache_dir() -> Path:
    path = Path(os.environ["EASYVLM_CACHE"]).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_path(easyvlm_cache_dir: Path) -> str:
    """Directory of the built-in ``tiny-qwen2.5-vl`` (HF format: model, tokenizer, processor)."""
    from easyvlm.builtin.models import materialize_model

    return str(materialize_model("tiny-qwen2.5-vl", cache_dir=easyvlm_cache_dir))


@pytest.fixture(scope="session")
def synthetic_train_file(easyvlm_cache_dir: Path) -> str:
    """JSONL of a small synthetic train split (images beside it, paths relative to its directory)."""
    from easyvlm.builtin.synthetic import materialize_dataset

    return str(materialize_dataset("train", cache_dir=easyvlm_cache_dir, num_samples=TEST_TRAIN_SIZE))


@pytest.fixture(scope="session")
def synthetic_val_file(easyvlm_cache_dir: Path) -> str:
    """JSONL of a small synthetic val split (disjoint from the train split)."""
    from easyvlm.builtin.synthetic import materialize_dataset

    return str(materialize_dataset("val", cache_dir=easyvlm_cache_dir, num_samples=TEST_VAL_SIZE))


@pytest.fixture(scope="module")
def process_group():
    """torch.distributed initialised as rank 0 of 1 (gloo), as the workers require. Checked per
    module: an in-process vLLM engine destroys the default group when it is torn down."""
    import torch.distributed as dist

    from easyvlm.workers.dist import init_distributed

    if not dist.is_initialized():
        init_distributed("gloo")
    assert dist.get_world_size() == 1
    return dist.group.WORLD


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch  # only when gpu tests were collected: importing torch costs seconds

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu); no CUDA device here")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def exported_reward_model(tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The ``huggingface/`` export of a reward model trained 3 steps from ``tiny-qwen2.5-vl`` by
    ``python -m easyvlm.rm`` (in this process: it initialises the gloo group of 1 the workers use)."""
    from easyvlm.rm.train import main

    out = tmp_path_factory.mktemp("reward_model")
    main([f"config={Path(__file__).resolve().parents[1] / 'examples' / 'rm.yaml'}", f"model.model_path={tiny_model_path}",
          "data.train_files=builtin:synthetic-preference@val", "data.val_files=", "trainer.val_before_train=false",
          "trainer.val_freq=-1", "trainer.max_steps=3", f"trainer.save_checkpoint_path={out}"])
    return str(out / "global_step_3" / "huggingface")
