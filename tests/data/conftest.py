"""Fixtures for the data pipeline tests: the tiny model's processor and config, a dataset builder."""

from __future__ import annotations

import pytest
from data_testing import data_config


@pytest.fixture(scope="session")
def processor(tiny_model_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def model_config(tiny_model_path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_model_path)


@pytest.fixture
def build(processor, model_config):
    """build(files, **config overrides) -> RLDataset over the tiny model's processor."""
    from easyvlm.data.dataset import RLDataset

    def _build(files, **overrides):
        return RLDataset(str(files), data_config(**overrides), processor.tokenizer, processor, model_config)

    return _build
