"""Fixtures of the rollout tests (helpers live in rollout_helpers.py)."""

from __future__ import annotations

import pytest
from rollout_helpers import PROMPTS, make_prompt_batch, noise_image

from easyvlm.data.batch import Batch


@pytest.fixture(scope="session")
def tiny_processor_and_config(tiny_model_path):
    from transformers import AutoConfig, AutoProcessor

    return AutoProcessor.from_pretrained(tiny_model_path), AutoConfig.from_pretrained(tiny_model_path)


@pytest.fixture()
def prompts(tiny_processor_and_config) -> Batch:
    """Three prompts: one image (portrait), two images, text only."""
    processor, config = tiny_processor_and_config
    return make_prompt_batch(
        processor, config, [(text, [noise_image(seed, size) for seed, size in images]) for text, images in PROMPTS]
    )
