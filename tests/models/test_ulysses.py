"""Ulysses sequence parallelism (easyvlm.models.ulysses and the padding-free forward with it).

The 2-rank tests spawn two gloo processes forming one sequence-parallel group (ulysses_size 2,
both ranks hold the same samples) under FSDP2 over both ranks (tests/models/ulysses_ranks.py), and
compare with one process without sequence parallelism: log-probs, entropies, values, and the full
gradients after one backward with ``loss_scale``.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from models_testing import build_tiny_text_model
from ulysses_ranks import (  # tests/models/ulysses_ranks.py: the spawned ranks' side
    CASES,
    batches,
    blocked_ids,
    load,
    logprobs_and_loss,
    two_rank_main,
    values_and_loss,
)

from easyvlm.models.ulysses import (
    UlyssesGroup,
    decoder_sees_slice,
    loss_scale,
    pad_packed_row,
    padded_length,
    ulysses_layout,
    ulysses_problem,
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

# ------------------------------------------------------------------------------------------------
# Pure functions

def test_ulysses_layout_by_hand():
    # 8 ranks in groups of 4: {0..3} is data-parallel rank 0, {4..7} rank 1
    assert ulysses_layout(5, 8, 4) == ([4, 5, 6, 7], 1, 2)
    assert ulysses_layout(0, 2, 2) == ([0, 1], 0, 1)
    assert ulysses_layout(3, 4, 1) == ([3], 3, 4)  # no sequence parallelism: every rank its own group
    with pytest.raises(ValueError, match=r"worker.actor.ulysses_size=4 must be >= 1 and divide the 6 ranks"):
        ulysses_layout(0, 6, 4)


def test_ulysses_problem(tiny_model_path):
    from transformers import AutoConfig, Qwen3Config

    text = AutoConfig.from_pretrained(tiny_model_path).get_text_config()  # 4 heads, 2 key/value heads
    assert ulysses_problem(text, 1) is None
    assert ulysses_problem(text, 2) is None
    message = ulysses_problem(text, 4)
    assert message == (
        "worker.actor.ulysses_size=4 does not divide the model's num_key_value_heads=2: Ulysses sequence "
        "parallelism gives each rank of a group whole attention heads; choose a ulysses_size in [1, 2]"
    )
    assert "num_attention_heads=4 and num_key_value_heads=2" in ulysses_problem(text, 3)
    assert "worker.critic.ulysses_size=4" in ulysses_problem(text, 4, key="worker.critic.ulysses_size")
    # EasyR1's qwen3_14b_dapo17k_dapo.sh: Qwen3-14B (40 heads, 8 key/value heads) with ulysses_size 8
    qwen3_14b = Qwen3Config(num_attention_heads=40, num_key_value_heads=8, hidden_size=5120, num_hidden_layers=1)
    assert ulysses_problem(qwen3_14b, 8) is None
    assert "num_attention_heads=40 and num_key_value_heads=8" in ulysses_problem(qwen3_14b, 16)


def test_loss_scale():
    # the normaliser is summed over all ranks, so FSDP's average times world_size is the global sum
    # (derivation in the docstring; the 2-rank gradient test below checks it)
    assert loss_scale(8, 4) == 8.0
    assert loss_scale(2, 2) == 2.0
    assert loss_scale(1, 1) == 1.0
    with pytest.raises(ValueError, match="divide the 6 ranks"):
        loss_scale(6, 4)


def test_pad_packed_row_by_hand():
    assert [padded_length(n, 2) for n in (6, 7)] == [6, 8]
    assert padded_length(7, 4) == 8
    ids = torch.tensor([[5, 6, 7]])
    positions = torch.tensor([[[0, 1, 0]], [[0, 9, 2]], [[0, 8, 3]], [[0, 7, 4]]])  # (4, 1, 3) mRoPE layout
    padded_ids, padded_positions = pad_packed_row(ids, positions, 2)
    assert padded_ids.tolist() == [[5, 6, 7, 0]]
    # the pad token starts a sequence of its own (position 0 in every row)
    assert padded_positions[:, 0].tolist() == [[0, 1, 0, 0], [0, 9, 2, 0], [0, 8, 3, 0], [0, 7, 4, 0]]
    padded_ids, padded_positions = pad_packed_row(ids, torch.tensor([[0, 1, 2]]), 5)  # (1, N) text positions
    assert padded_ids.tolist() == [[5, 6, 7, 0, 0]] and padded_positions.tolist() == [[0, 1, 2, 0, 1]]
    assert pad_packed_row(ids, positions, 3)[0] is ids  # already a multiple: untouched


@pytest.mark.parametrize("head", ["causal_lm", "token_classification"])
def test_decoder_sees_its_slice(tmp_path, head):
    """A text-only model under decoder_sees_slice(model, 3, 4) equals the model run on tokens 3..6
    with their positions (without the Ulysses attention, a slice attends to itself only). Token
    classification passes input_ids to its decoder positionally, the causal LM by keyword."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from easyvlm.models.padding_free import VARLEN_ATTENTION, register_varlen_attention

    model_dir = build_tiny_text_model(tmp_path)
    register_varlen_attention()
    auto_cls = {"causal_lm": AutoModelForCausalLM, "token_classification": AutoModelForTokenClassification}[head]
    torch.manual_seed(0)
    model = auto_cls.from_pretrained(model_dir, attn_implementation=VARLEN_ATTENTION).eval()
    ids = torch.tensor([[11, 12, 13, 14, 15, 16, 17]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1]])  # three packed sequences; the slice holds the last two
    with torch.no_grad():
        expected = model(input_ids=ids[:, 3:], position_ids=torch.tensor([[0, 1, 0, 1]])).logits
        one_sequence = model(input_ids=ids[:, 3:], position_ids=torch.tensor([[0, 1, 2, 3]])).logits
        with decoder_sees_slice(model, 3, 4):
            sliced = model(input_ids=ids, position_ids=positions).logits
        whole = model(input_ids=ids, position_ids=positions).logits  # the hook is gone after the block
    torch.testing.assert_close(sliced, expected)
    assert (one_sequence - expected).abs().max() > 1e-4  # so the positions were cut, not rebuilt
    assert whole.shape[1] == 7
    torch.testing.assert_close(whole[:, 3:], expected)  # packed: the same sequences, the same outputs


def test_decoder_sees_its_slice_with_deepstack(easyvlm_cache_dir):
    """Qwen3-VL adds DeepStack features to the first decoder layers' hidden states at the image
    tokens: a slice must get the rows of its own image tokens. Two packed image prompts; the slice
    is the second one, whole, so it equals that prompt run alone with its image. (Without the cut of
    ``visual_pos_masks`` the forward fails; with the rows of the first image it differs.)"""
    from transformers import AutoConfig, AutoProcessor

    from easyvlm.builtin.models import materialize_model
    from easyvlm.models.position_ids import get_position_ids

    model_dir = str(materialize_model("tiny-qwen3-vl", cache_dir=easyvlm_cache_dir))
    processor, config = AutoProcessor.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(0)
    parts = []
    for text, (h, w) in (("first", (64, 96)), ("second", (96, 64))):
        image = torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy()
        enc = processor(text=[f"<|vision_start|><|image_pad|><|vision_end|>{text}"], images=[image], return_tensors="pt")
        positions = get_position_ids(enc["input_ids"], enc["attention_mask"], enc["image_grid_thw"], model_config=config)
        parts.append((enc["input_ids"], positions.transpose(0, 1), enc["pixel_values"], enc["image_grid_thw"]))
    model = load(model_dir).eval()
    (ids_a, pos_a, pv_a, grid_a), (ids_b, pos_b, pv_b, grid_b) = parts
    with torch.no_grad():
        alone = model(input_ids=ids_b, position_ids=pos_b, pixel_values=pv_b, image_grid_thw=grid_b).logits
        with decoder_sees_slice(model, ids_a.shape[1], ids_b.shape[1]):
            sliced = model(input_ids=torch.cat([ids_a, ids_b], 1), position_ids=torch.cat([pos_a, pos_b], -1),
                           pixel_values=torch.cat([pv_a, pv_b]), image_grid_thw=torch.cat([grid_a, grid_b])).logits
    torch.testing.assert_close(sliced, alone)


def test_bad_ulysses_settings_are_refused_before_any_collective(tiny_model_path):
    """Key/value heads that the group size does not divide, a model without the varlen attention,
    and the padded forward are errors that name the setting (no process group is needed to see them)."""
    from transformers import AutoModelForImageTextToText

    from easyvlm.workers.forward import ForwardSetup, outputs_with_vision, policy_logprobs
    from easyvlm.workers.vision_dummy import dummy_image_for

    batch = batches(tiny_model_path)["short"]
    blocked = blocked_ids(tiny_model_path)

    def run(model, size: int, padding_free: bool = True):
        group = UlyssesGroup(group=None, size=size, rank=0, dp_rank=0, dp_size=1)  # never reached
        setup = ForwardSetup(torch.device("cpu"), padding_free, blocked_token_ids=tuple(blocked),
                             dummy_image=dummy_image_for(model.config), ulysses=group)
        policy_logprobs(model, batch, setup, with_entropy=False)

    varlen = load(tiny_model_path)
    with pytest.raises(ValueError, match=r"worker.actor.ulysses_size=4 does not divide .* num_key_value_heads=2"):
        run(varlen, 4)
    with pytest.raises(ValueError, match="needs worker.actor.padding_free=true"):
        run(varlen, 2, padding_free=False)
    sdpa = AutoModelForImageTextToText.from_pretrained(tiny_model_path, attn_implementation="sdpa")
    with pytest.raises(ValueError, match="attn_implementation='easyvlm_varlen'"):
        run(sdpa, 2)
    critic = load(tiny_model_path, "critic")  # the value head: the critic's setting is named
    with pytest.raises(ValueError, match=r"worker.critic.ulysses_size=4 does not divide"):
        group = UlyssesGroup(group=None, size=4, rank=0, dp_rank=0, dp_size=1)
        setup = ForwardSetup(torch.device("cpu"), True, dummy_image=dummy_image_for(critic.config), ulysses=group)
        outputs_with_vision(critic, batch, setup, lm_head=False)


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_linear_attention_is_refused_before_any_collective(easyvlm_cache_dir, name):
    """Qwen3.5's gated-DeltaNet layers carry a recurrent state (and a short convolution) along the
    whole sequence: a rank's slice of the row would start from a zero state. Their heads alone would
    allow ulysses_size 2, so the refusal is the linear attention's; the policy's and the critic's
    forward name their setting before any collective (no process group here). The config check's
    refusal: tests/plan/test_checks.py."""
    from transformers import AutoConfig

    from easyvlm.builtin.models import materialize_model
    from easyvlm.models.linear_attention import segment_linear_attention
    from easyvlm.workers.forward import ForwardSetup, outputs_with_vision, policy_logprobs
    from easyvlm.workers.vision_dummy import dummy_image_for

    model_dir = str(materialize_model(name, cache_dir=easyvlm_cache_dir))
    text = AutoConfig.from_pretrained(model_dir).get_text_config()
    assert text.num_attention_heads % 2 == 0 and text.num_key_value_heads % 2 == 0
    assert ulysses_problem(text, 1) is None
    assert ulysses_problem(text, 2) == (
        "worker.actor.ulysses_size=2: the model has linear-attention layers, whose recurrent state runs along the "
        "whole sequence; Ulysses sequence parallelism splits the sequence over ranks: set worker.actor.ulysses_size=1"
    )
    batch = batches(model_dir)["short"]
    group = UlyssesGroup(group=None, size=2, rank=0, dp_rank=0, dp_size=1)  # never reached
    policy, critic = load(model_dir), load(model_dir, "critic")
    for model in (policy, critic):
        assert segment_linear_attention(model) == 3  # as load_model does for padding-free models
    setup = ForwardSetup(torch.device("cpu"), True, blocked_token_ids=tuple(blocked_ids(model_dir)),
                         dummy_image=dummy_image_for(policy.config), ulysses=group)
    with pytest.raises(ValueError, match=r"^worker\.actor\.ulysses_size=2: the model has linear-attention layers"):
        policy_logprobs(policy, batch, setup, with_entropy=False)
    setup = ForwardSetup(torch.device("cpu"), True, dummy_image=dummy_image_for(critic.config), ulysses=group)
    with pytest.raises(ValueError, match=r"^worker\.critic\.ulysses_size=2: the model has linear-attention layers"):
        outputs_with_vision(critic, batch, setup, lm_head=False)


def test_qwen3_vl_moe_heads_allow_two_ranks(easyvlm_cache_dir):
    """Qwen3-VL-MoE's decoder is softmax attention only: ulysses_size 2 divides its heads and passes."""
    from transformers import AutoConfig

    from easyvlm.builtin.models import materialize_model

    model_dir = materialize_model("tiny-qwen3-vl-moe", cache_dir=easyvlm_cache_dir)
    text = AutoConfig.from_pretrained(model_dir).get_text_config()
    assert ulysses_problem(text, 2) is None
    assert "num_key_value_heads=2" in ulysses_problem(text, 4)


# ------------------------------------------------------------------------------------------------
# Two ranks, one sequence-parallel group


@pytest.fixture(scope="module")
def two_ranks(tiny_model_path, tmp_path_factory) -> list[dict]:
    from easyvlm.workers.dist import find_free_port

    out_file = str(tmp_path_factory.mktemp("ulysses") / "two_ranks.pt")
    mp.spawn(two_rank_main, args=(2, find_free_port(), tiny_model_path, out_file), nprocs=2, join=True)
    return torch.load(out_file, weights_only=False)


@pytest.fixture(scope="module")
def one_rank(tiny_model_path) -> dict:
    """The same computations in this process: padding-free, no sequence parallelism, no FSDP."""
    from easyvlm.algorithms.aggregation import loss_normalizer

    data = batches(tiny_model_path)
    blocked = blocked_ids(tiny_model_path)
    model = load(tiny_model_path)
    out: dict = {}
    for name, share in CASES:
        batch = data[name]
        normalizer = loss_normalizer(batch["response_mask"], "token")
        logprobs, entropies, loss = logprobs_and_loss(model, batch, blocked, share_prompts=share, normalizer=normalizer)
        (loss * loss_scale(1, 1)).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out[(name, share)] = dict(logprobs=logprobs.detach(), entropies=entropies.detach(), normalizer=normalizer,
                                  grads=grads)
        model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logprobs, entropies, _ = logprobs_and_loss(model, data["text"], blocked, share_prompts=False, normalizer=1.0)
    out["text"] = dict(logprobs=logprobs, entropies=entropies)
    critic = load(tiny_model_path, "critic")
    batch = data["mixed"]
    values, loss = values_and_loss(critic, batch, normalizer=loss_normalizer(batch["response_mask"], "token"))
    loss.backward()
    out["critic"] = dict(values=values.detach(),
                         grads={n: p.grad.clone() for n, p in critic.named_parameters() if p.grad is not None})
    return out


@pytest.mark.slow
def test_groups_of_two_ranks(two_ranks):
    # (rank in the group, group size, data-parallel rank, data-parallel size)
    assert two_ranks[0]["sp"] == (0, 2, 0, 1)
    assert two_ranks[1]["sp"] == (1, 2, 0, 1)


@pytest.mark.slow
def test_all_to_alls_by_hand(two_ranks):
    # rank r held x_r[0, h, t, d] = 1000 r + 100 h + 10 t + d: 4 heads of its 3 tokens. After
    # sequence_to_heads, rank j holds heads 2j, 2j + 1 of all 6 tokens (rank 0's 3, then rank 1's).
    for j in (0, 1):
        p = two_ranks[j]["primitives"]
        h = 2 * j + torch.arange(2)[:, None, None]
        token = torch.arange(6)[None, :, None]
        expected = 1000 * (token // 3) + 100 * h + 10 * (token % 3) + torch.arange(2)[None, None, :]
        torch.testing.assert_close(p["y"], expected.float().unsqueeze(0), rtol=0, atol=0)
        # heads_to_sequence is the inverse: rank j gets back its own x, in (1, tokens, heads, D)
        x = (1000 * j + 100 * torch.arange(4)[:, None, None] + 10 * torch.arange(3)[None, :, None]
             + torch.arange(2)[None, None, :]).float()
        torch.testing.assert_close(p["back"], x.transpose(0, 1).unsqueeze(0), rtol=0, atol=0)
    # backward of sum(y_j * w_j) over both ranks: x_r[h, t] went to rank h // 2 as its head h % 2,
    # token 3 r + t, so its gradient is that rank's weight there
    w = [two_ranks[j]["primitives"]["weight"][0] for j in (0, 1)]  # (2, 6, 2) each
    for r in (0, 1):
        expected = torch.stack([w[h // 2][h % 2, 3 * r : 3 * r + 3] for h in range(4)]).unsqueeze(0)
        torch.testing.assert_close(two_ranks[r]["primitives"]["x_grad"], expected, rtol=0, atol=0)


@pytest.mark.slow
def test_sum_over_group_by_hand(two_ranks):
    # s_0 = [1, 2], s_1 = [2, 4]: both ranks get [3, 6]. Rank r's loss is sum(total * [3, 5] * (r+1)),
    # and both losses depend on both s: d/ds_r = [3, 5] * 1 + [3, 5] * 2 = [9, 15] on both ranks
    for r in (0, 1):
        p = two_ranks[r]["primitives"]
        assert p["total"].tolist() == [3.0, 6.0]
        assert p["s_grad"].tolist() == [9.0, 15.0]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=["mixed", "mixed-shared-prompts", "rank0-without-responses"])
def test_logprobs_and_gradients_equal_one_process(two_ranks, one_rank, tiny_model_path, case):
    """Images and text-only rows, shared prompts off and on, and a sample whose response positions
    all fall in rank 1's half of the row (rank 0 still runs every collective of the backward)."""
    mask = batches(tiny_model_path)[case[0]]["response_mask"]
    expected = one_rank[case]
    for rank in (0, 1):
        got = two_ranks[rank][case]
        torch.testing.assert_close(got["logprobs"][mask], expected["logprobs"][mask])
        torch.testing.assert_close(got["entropies"][mask], expected["entropies"][mask])
        assert torch.all(got["logprobs"][~mask] == 0)
        # the actor's convention: the normaliser summed over both ranks counts every sample twice
        assert got["normalizer"] == 2 * expected["normalizer"]
        assert got["grads"].keys() == expected["grads"].keys()
        assert any(name.startswith("model.visual") for name in expected["grads"])  # the vision tower trains too
        for name, grad in expected["grads"].items():
            # atol 1e-6: float32 sums in another order (per-head blocks, FSDP's reduce-scatter); the
            # largest entries are ~1e-1, and a wrong loss_scale would be off by a factor of 2
            torch.testing.assert_close(got["grads"][name], grad, rtol=1.3e-6, atol=1e-6, msg=name)


@pytest.mark.slow
def test_text_only_micro_batch_with_the_dummy_image(two_ranks, one_rank, tiny_model_path):
    mask = batches(tiny_model_path)["text"]["response_mask"]
    for rank in (0, 1):
        torch.testing.assert_close(two_ranks[rank]["text"]["logprobs"][mask], one_rank["text"]["logprobs"][mask])
        torch.testing.assert_close(two_ranks[rank]["text"]["entropies"][mask], one_rank["text"]["entropies"][mask])


@pytest.mark.slow
def test_critic_values_and_gradients_equal_one_process(two_ranks, one_rank, tiny_model_path):
    mask = batches(tiny_model_path)["mixed"]["response_mask"]
    expected = one_rank["critic"]
    for rank in (0, 1):
        got = two_ranks[rank]["critic"]
        torch.testing.assert_close(got["values"][mask], expected["values"][mask])
        assert got["grads"].keys() == expected["grads"].keys()
        for name, grad in expected["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1.3e-6, atol=1e-6, msg=name)
