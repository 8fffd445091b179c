"""End-to-end trainer fixtures: the common command line of a tiny run, and an in-process Ray session.

Every run trains the built-in ``tiny-qwen2.5-vl`` on the test-sized synthetic splits (offline), with
batches small enough that one step takes seconds on the CPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

# One torch thread per rank: on the shared 2-core machine, two threads per tiny-model rank run ~10x
# slower than one (see easyvlm.distributed.worker_group.cpu_threads).
E2E_ENV = {"OMP_NUM_THREADS": "1", "EASYVLM_LOG_DATA_ORDER": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="session")
def e2e_base_args(synthetic_train_file: str, synthetic_val_file: str) -> list[str]:
    """``key=value`` arguments of a 2-step GRPO run on the tiny model (add save path and overrides).

    4 prompts x 4 samples = 16 sequences of at most 8 response tokens per step, one PPO mini-batch
    in micro-batches of 4, no validation (the tests that want it turn it on), no console output.
    """
    return [
        f"config={REPO_ROOT / 'examples' / 'config.yaml'}",
        f"data.format_prompt={REPO_ROOT / 'format_prompts' / 'synthetic.jinja'}",
        f"worker.reward.reward_function={REPO_ROOT / 'reward_functions' / 'synthetic.py'}:compute_score",
        f"data.train_files={synthetic_train_file}",
        f"data.val_files={synthetic_val_file}",
        "worker.actor.model.model_path=builtin:tiny-qwen2.5-vl",
        "data.rollout_batch_size=4",
        "data.max_response_length=8",
        "worker.rollout.n=4",
        "worker.actor.global_batch_size=4",
        "worker.actor.micro_batch_size_per_device_for_update=4",
        "worker.actor.micro_batch_size_per_device_for_experience=8",
        "worker.rollout.max_num_seqs=16",
        "trainer.n_gpus_per_node=1",
        "trainer.max_steps=2",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
        "trainer.logger=[file]",
    ]


@pytest.fixture(scope="session")
def e2e_env() -> dict[str, str]:
    """Environment variables of every end-to-end run (in-process or a subprocess)."""
    return dict(E2E_ENV)


@pytest.fixture(scope="class")
def e2e_ray():
    """Environment for in-process runs, and one Ray session for all runs of a test class.

    ``easyvlm.trainer.main.main`` starts Ray on its first call (forwarding the environment to the
    workers) and leaves it up; each run stops its own actors. Ray is shut down at the end.
    """
    import ray

    if ray.is_initialized():  # another module's session, without our environment
        ray.shutdown()
    saved = {k: os.environ.get(k) for k in E2E_ENV}
    os.environ.update(E2E_ENV)
    yield
    ray.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
