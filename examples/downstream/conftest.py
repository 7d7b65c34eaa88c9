from __future__ import annotations

import pytest
import tinylm
import torch


@pytest.fixture
def config():
    return tinylm.tiny_config()


@pytest.fixture
def model(config):
    # built per test: under ``--layerswap`` (or a ``layerswap`` marker) the decoder
    # layers are the replacement class from the start
    return tinylm.build(config, seed=0).eval()


@pytest.fixture
def input_ids(config):
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, config.vocab_size, (2, 16), generator=generator)
