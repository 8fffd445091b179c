"""The 2-rank side of tests/models/test_ulysses.py: spawned gloo processes with ulysses_size 2 (one
sequence-parallel group of both ranks, holding the same samples), FSDP2 over both ranks. Rank 0
saves what the tests compare against one process without sequence parallelism."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
from workers_testing import make_rl_batch  # noqa: E402  (the workers' test-batch builder)

from easyvlm.data.batch import Batch  # noqa: E402

# Mixed: two image prompts (two sizes), two text-only ones; ragged prompt and response lengths.
PROMPTS = [
    ("what is it?", (56, 56)),
    ("hi", None),
    ("count the dots, please", (84, 56)),
    ("a longer text-only question", None),
]
GROUP = 2  # samples per prompt, in a row: shared prompts have something to share
RESPONSE_LENGTHS = [5, 2, 7, 3, 1, 6, 4, 5]  # packed: 337 tokens, 185 with shared prompts (odd: padded)
TEXT_PROMPTS = [("hi", None), ("why", None)]  # no image: the dummy image runs
TEXT_RESPONSE_LENGTHS = [3, 5]
# one sample whose response predictions all sit in the second half of the row: rank 0 has none
SHORT_PROMPTS = [("a long question about nothing much", (56, 56))]
SHORT_RESPONSE_LENGTHS = [2]
TEMPERATURE = 0.7
CASES = [("mixed", False), ("mixed", True), ("short", False)]  # (batch, share_prompts) with a backward
ENTROPY_COEF = 0.3


def batches(model_dir: str) -> dict[str, Batch]:
    mixed = make_rl_batch(model_dir, PROMPTS, RESPONSE_LENGTHS, n=GROUP)
    gen = torch.Generator().manual_seed(1)
    mixed["advantages"] = torch.randn(mixed["responses"].shape, generator=gen)
    text = make_rl_batch(model_dir, TEXT_PROMPTS, TEXT_RESPONSE_LENGTHS)
    text["advantages"] = torch.zeros(text["responses"].shape)
    short = make_rl_batch(model_dir, SHORT_PROMPTS, SHORT_RESPONSE_LENGTHS)
    short["advantages"] = torch.ones(short["responses"].shape)
    return {"mixed": mixed, "text": text, "short": short}


def load(model_dir: str, role: str = "policy"):
    """The policy, or the critic (the backbone plus easyvlm's value head), as the workers run them:
    the text decoder on the padding-free attention, gradient checkpointing on (its recomputation
    repeats the attention's all-to-alls in the backward)."""
    from transformers import AutoModel, AutoModelForImageTextToText

    from easyvlm.models.loading import ValueHeadModel
    from easyvlm.models.padding_free import VARLEN_ATTENTION, register_varlen_attention

    register_varlen_attention()
    kwargs = dict(attn_implementation={"": "sdpa", "text_config": VARLEN_ATTENTION, "vision_config": "sdpa"},
                  dtype=torch.float32)
    if role == "policy":
        model = transformers_model = AutoModelForImageTextToText.from_pretrained(model_dir, **kwargs)
    else:
        transformers_model = AutoModel.from_pretrained(model_dir, **kwargs)
        torch.manual_seed(0)  # the new value head: the same on every rank
        model = ValueHeadModel(transformers_model, transformers_model.config.get_text_config().hidden_size)
    transformers_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def shard(model):
    """FSDP2 over all ranks: each decoder layer and vision block, then the root."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in list(model.modules()):
        if type(module).__name__ in ("Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"):
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def blocked_ids(model_dir: str) -> list[int]:
    from transformers import AutoConfig, AutoTokenizer

    from easyvlm.rollout.tokens import blocked_token_ids

    return blocked_token_ids(AutoTokenizer.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir))


def logprobs_and_loss(model, batch: Batch, blocked, *, share_prompts: bool, normalizer: float, ulysses=None):
    """policy_logprobs with entropies, and the actor-style loss: token-mean of
    -advantage * logprob - ENTROPY_COEF * entropy, divided by ``normalizer``."""
    from easyvlm.algorithms.aggregation import aggregate_loss
    from easyvlm.workers.forward import ForwardSetup, policy_logprobs
    from easyvlm.workers.vision_dummy import dummy_image_for

    setup = ForwardSetup(torch.device("cpu"), True, blocked_token_ids=tuple(blocked), temperature=TEMPERATURE,
                         share_prompts=share_prompts, dummy_image=dummy_image_for(model.config), ulysses=ulysses)
    logprobs, entropies = policy_logprobs(model, batch, setup, with_entropy=True)
    mask = batch["response_mask"]
    token_losses = -batch["advantages"] * logprobs - ENTROPY_COEF * entropies
    return logprobs, entropies, aggregate_loss(token_losses, mask, "token", normalizer)


def values_and_loss(critic, batch: Batch, *, normalizer: float, ulysses=None):
    """The critic's (B, T) values and a loss linear in them: token-mean of advantage * value."""
    from easyvlm.algorithms.aggregation import aggregate_loss
    from easyvlm.workers.forward import ForwardSetup, outputs_with_vision, scatter_response
    from easyvlm.workers.vision_dummy import dummy_image_for

    setup = ForwardSetup(torch.device("cpu"), True, dummy_image=dummy_image_for(critic.config), ulysses=ulysses)
    out, valid = outputs_with_vision(critic, batch, setup, lm_head=False)  # (K, 1)
    values = scatter_response(out[:, 0], valid)
    return values, aggregate_loss(batch["advantages"] * values, batch["response_mask"], "token", normalizer)


def full_gradients(model) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (FSDP2 keeps each rank's shard: gather them)."""
    return {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}


def primitives(sp) -> dict[str, torch.Tensor]:
    """The all-to-alls and the group sum on small known tensors, with gradients."""
    from easyvlm.models.ulysses import heads_to_sequence, sequence_to_heads, sum_over_group

    r = sp.rank
    # x[0, h, t, d] = 1000 r + 100 h + 10 t + d: which rank, head, token, feature it came from
    x = (1000 * r + 100 * torch.arange(4)[:, None, None] + 10 * torch.arange(3)[None, :, None]
         + torch.arange(2)[None, None, :]).float().unsqueeze(0).requires_grad_()  # (1, 4, 3, 2)
    y = sequence_to_heads(x, sp)  # (1, 2, 6, 2)
    weight = torch.arange(y.numel(), dtype=torch.float32).reshape(y.shape) + 100 * r
    (y * weight).sum().backward()
    back = heads_to_sequence(y.detach().transpose(1, 2), sp)  # (1, 3, 4, 2)
    s = torch.tensor([1.0, 2.0]) * (r + 1)
    s.requires_grad_()
    total = sum_over_group(s, sp)
    (total * torch.tensor([3.0, 5.0]) * (r + 1)).sum().backward()
    return dict(y=y.detach(), x_grad=x.grad, back=back, weight=weight, total=total.detach(), s_grad=s.grad)


def two_rank_main(rank: int, world_size: int, port: int, model_dir: str, out_file: str) -> None:
    import torch.distributed as dist

    from easyvlm.algorithms.aggregation import loss_normalizer
    from easyvlm.models.ulysses import loss_scale, new_ulysses_group
    from easyvlm.workers.dist import init_distributed
    from easyvlm.workers.training import all_reduce_sums

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed("gloo")
    sp = new_ulysses_group(world_size)
    out: dict = {"primitives": primitives(sp), "sp": (sp.rank, sp.size, sp.dp_rank, sp.dp_size)}

    data = batches(model_dir)
    blocked = blocked_ids(model_dir)
    device = torch.device("cpu")
    model = shard(load(model_dir))
    for name, share in CASES:
        batch = data[name]
        # the actor's normaliser: summed over all ranks (each sample counted ulysses_size times)
        normalizer = all_reduce_sums({"n": loss_normalizer(batch["response_mask"], "token")}, device)["n"]
        logprobs, entropies, loss = logprobs_and_loss(
            model, batch, blocked, share_prompts=share, normalizer=normalizer, ulysses=sp
        )
        (loss * loss_scale(world_size, sp.size)).backward()
        out[(name, share)] = dict(
            logprobs=logprobs.detach(), entropies=entropies.detach(), normalizer=normalizer, grads=full_gradients(model)
        )
        model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logprobs, entropies, _ = logprobs_and_loss(model, data["text"], blocked, share_prompts=False, normalizer=1.0,
                                                   ulysses=sp)
    out["text"] = dict(logprobs=logprobs, entropies=entropies)

    critic = shard(load(model_dir, "critic"))
    batch = data["mixed"]
    normalizer = all_reduce_sums({"n": loss_normalizer(batch["response_mask"], "token")}, device)["n"]
    values, loss = values_and_loss(critic, batch, normalizer=normalizer, ulysses=sp)
    (loss * loss_scale(world_size, sp.size)).backward()
    out["critic"] = dict(values=values.detach(), grads=full_gradients(critic))

    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, out)
    if rank == 0:
        torch.save(per_rank, out_file)
    dist.barrier()
    dist.destroy_process_group()
