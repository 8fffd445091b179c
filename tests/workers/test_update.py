"""easyvlm/workers/update.py: what TrainedModel gives back while its role is idle (``worker.*.offload``).

Moving memory to the host is a GPU matter (on the CPU the helpers are no-ops, and the run plan says
so in a notice); what is checked here is that each key sends exactly its part away and back.
"""

from __future__ import annotations

import pytest
import torch

from easyvlm.workers.settings import OffloadConfig, OptimConfig, UpdateSettings
from easyvlm.workers.specs import MicroBatching, UpdateSpec
from easyvlm.workers import update as update_module
from easyvlm.workers.update import TrainedModel

UPDATE = UpdateSpec(
    settings=UpdateSettings(), mini_batch_per_rank=1, optimizer_steps_per_step=1, micro=MicroBatching(1, False, None),
    norm_length=1, optim=OptimConfig(), total_steps=1,
)


@pytest.mark.parametrize(("offload_params", "offload_optimizer"), [(False, False), (True, False), (False, True), (True, True)])
def test_offload_moves_what_the_keys_ask_and_brings_it_back(monkeypatch, offload_params, offload_optimizer):
    moves = []
    monkeypatch.setattr(update_module, "offload_model", lambda model: moves.append(("params", "host")))
    monkeypatch.setattr(update_module, "offload_optimizer", lambda optimizer: moves.append(("optimizer", "host")))
    monkeypatch.setattr(update_module, "load_model_to", lambda model, device: moves.append(("params", device.type)))
    monkeypatch.setattr(update_module, "load_optimizer_to", lambda optimizer, device: moves.append(("optimizer", device.type)))
    offload = OffloadConfig(offload_params=offload_params, offload_optimizer=offload_optimizer)
    trained = TrainedModel(torch.nn.Linear(2, 1), UPDATE, offload, torch.device("cpu"), "actor", grad_scale=1.0, loss_avg_mode="token")
    trained.offload()
    assert moves == [("params", "host")] * offload_params + [("optimizer", "host")] * offload_optimizer
    moves.clear()
    trained.ensure_loaded()  # before the next pass (both helpers skip what is already on the device)
    assert moves == [("params", "cpu"), ("optimizer", "cpu")]
    moves.clear()
    trained.ensure_loaded()
    assert moves == []
