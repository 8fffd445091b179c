"""Router replay (easyvlm.models.moe_routing) on the builtin tiny Qwen3.5-MoE and Qwen3-VL-MoE.

References: transformers' own unmodified models (their routers, their ``aux_loss``), and routing
weights derived by hand on a 4-expert router.
"""

from __future__ import annotations

import math

import pytest
import torch

from easyvlm.models.moe_routing import (
    FREE,
    ReplayRouter,
    RoutingState,
    expert_load,
    install_replay_routers,
    load_balancing_loss,
    routing_state,
)

MODELS = ["tiny-qwen3.5-moe", "tiny-qwen3-vl-moe"]


@pytest.fixture(scope="module", params=MODELS)
def model_dir(request, easyvlm_cache_dir) -> str:
    from easyvlm.builtin.models import materialize_model

    return str(materialize_model(request.param, cache_dir=easyvlm_cache_dir))


def _load(model_dir: str):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


def _inputs(model, seed: int = 0, batch: int = 2, length: int = 24) -> dict:
    """A left-padded text batch (row 1 has 5 padding tokens) of random token ids."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, 256, (batch, length), generator=g) % vocab
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, :5] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_hand_derived_replay_weights():
    """E = 4, k = 2, hidden 1 with input 1.0: logits = the router's weight column [2, 1, 0, -1].
    Free: experts (0, 1), weights e^2 / (e^2 + e^1) = 0.7311, e / (e^2 + e) = 0.2689.
    Replaying (3, 0): weights e^-1 / (e^-1 + e^2) = 0.04743 and e^2 / (e^-1 + e^2) = 0.95257 (the
    softmax's normaliser cancels), and the router's weight gets a gradient only in rows 3 and 0:
    for f = 1 * w3 + 2 * w0 = (a + 2b) / (a + b), a = e^l3, b = e^l0: df/dl3 = -ab / (a + b)^2
    = -e / (e^-1 + e^2)^2 = -0.04518, df/dl0 = +0.04518 (x = 1, so these are the weight's gradients)."""

    class Original(torch.nn.Module):
        top_k, num_experts, hidden_dim = 2, 4, 1

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.tensor([[2.0], [1.0], [0.0], [-1.0]]))

    state = RoutingState(num_layers=1, top_k=2, num_experts=4)
    router = ReplayRouter(Original(), layer=0, state=state)
    x = torch.ones(1, 1)
    with state.forward():
        _, weights, index = router(x)
    assert index.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, torch.tensor([[math.e**2 / (math.e**2 + math.e), math.e / (math.e**2 + math.e)]]))
    with state.forward(replay=torch.tensor([[[3, 0]]])):
        _, weights, index = router(x)
    assert index.tolist() == [[3, 0]] and state.recorded().tolist() == [[[3, 0]]]
    expected = torch.tensor([[math.exp(-1), math.exp(2)]]) / (math.exp(-1) + math.exp(2))
    torch.testing.assert_close(weights, expected)  # [0.04743, 0.95257]
    (weights * torch.tensor([[1.0, 2.0]])).sum().backward()
    grad = router.weight.grad.reshape(-1)
    slope = math.e / (math.exp(-1) + math.exp(2)) ** 2
    # rows 1 and 2 only through the softmax's normaliser, which cancels: zero up to float32 rounding
    torch.testing.assert_close(grad, torch.tensor([slope, 0.0, 0.0, -slope]), rtol=1e-5, atol=1e-8)
    with state.forward(replay=torch.tensor([[[FREE, FREE]]])):  # FREE: the router's own choice
        _, _, index = router(x)
    assert index.tolist() == [[0, 1]]


def test_replay_routers_leave_the_model_unchanged(model_dir):
    reference = _load(model_dir)
    model = _load(model_dir)
    state = install_replay_routers(model)
    assert state is not None and routing_state(model) is state
    assert state.num_layers == model.config.get_text_config().num_hidden_layers  # every layer is sparse
    assert (state.top_k, state.num_experts) == (2, 4)
    assert model.state_dict().keys() == reference.state_dict().keys()
    inputs = _inputs(model)
    with torch.no_grad(), state.forward():
        ours = model(**inputs).logits
    assert torch.equal(ours, reference(**inputs).logits)
    assert state.recorded().shape == (2 * 24, state.num_layers, 2)


def test_a_drifted_router_still_routes_as_recorded(model_dir):
    """Record the experts, then change every router's weights (as an update would): free routing
    now picks other experts for some tokens, the replay picks exactly the recorded ones, and
    replaying a model's own choices changes nothing."""
    model = _load(model_dir)
    state = install_replay_routers(model)
    inputs = _inputs(model, seed=1)
    with torch.no_grad(), state.forward():
        model(**inputs)
    recorded = state.recorded()
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, ReplayRouter):
                module.weight.add_(torch.randn_like(module.weight) * module.weight.std() * 2)
        with state.forward():
            drifted_logits = model(**inputs).logits
        drifted = state.recorded()
        assert (drifted != recorded).any(), "the drift must change some choices, or the test shows nothing"
        with state.forward(replay=recorded):
            replayed_logits = model(**inputs).logits
        assert torch.equal(state.recorded(), recorded)
        assert not torch.allclose(replayed_logits, drifted_logits)
        with state.forward(replay=drifted):  # its own choices: the free forward, bitwise
            assert torch.equal(model(**inputs).logits, drifted_logits)


def test_load_balancing_loss_is_the_models_aux_loss(model_dir):
    """transformers' forward with output_router_logits computes the model's aux loss over all tokens
    (no padding here); the routers' kept logits give the same value."""
    reference = _load(model_dir)
    model = _load(model_dir)
    state = install_replay_routers(model)
    inputs = {"input_ids": _inputs(model, seed=2)["input_ids"]}
    expected = reference(**inputs, output_router_logits=True).aux_loss
    with state.forward(keep_logits=True):
        model(**inputs)
        ours = load_balancing_loss(state.logits, state.num_experts, state.top_k)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    assert ours.requires_grad  # it trains the routers


def test_expert_load_by_hand():
    # E = 4, k = 2: tokens choose {0, 1} and {0, 2} in layer 0, {3, 2} and {3, 1} in layer 1:
    # 4 slots per layer; counts [2, 1, 1, 0] and [0, 1, 1, 2]; loads = counts * 4 / 4
    chosen = torch.tensor([[[0, 1], [3, 2]], [[0, 2], [3, 1]]])
    assert expert_load(chosen, 4).tolist() == [[2.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 2.0]]
