"""Fixtures of the rollout tests (helpers live in rollout_helpers.py)."""

from __future__ import annotations

import pytest
from rollout_helpers import default_prompts

from easyvlm.data.batch import Batch


@pytest.fixture(scope="session")
def tiny_processor_and_config(tiny_model_path):
    from transformers import AutoConfig, AutoProcessor

    return AutoProcessor.from_pretrained(tiny_model_path), AutoConfig.from_pretrained(tiny_model_path)


@pytest.fixture()
def prompts(tiny_processor_and_config) -> Batch:
    """Three prompts: one image (portrait), two images, text only."""
    return default_prompts(*tiny_processor_and_config)
