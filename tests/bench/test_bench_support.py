"""The FLOP count behind bench/vs_trl.py's efficiency, against numbers derived by hand."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from bench_support import ModelParams, essential_flops  # noqa: E402


def test_essential_flops_by_hand():
    # decoder 10, vision 3 parameters; prompts of 4 tokens (16 patches) and 6 tokens (no image);
    # n = 2 samples of 5 tokens each
    flops = essential_flops(ModelParams(total=0, decoder=10, vision=3), [4, 6], [16, 0], n=2, response_length=5)
    # prefill: 2*10*4 + 2*3*16 + 2*10*6 = 80 + 96 + 120
    assert flops["prefill"] == 296
    # decode: 2*10 per token x 2 samples x 5 tokens x 2 prompts
    assert flops["decode"] == 400
    # train: 6*10*2*(4+5) + 6*3*2*16 + 6*10*2*(6+5) = 1080 + 576 + 1320
    assert flops["train"] == 2976
    assert flops["total"] == 296 + 400 + 2976
    # shared prompts: each prompt once per group: 6*10*(4+2*5) + 6*3*16 + 6*10*(6+2*5) = 840 + 288 + 960
    assert flops["train_shared_prompts"] == 2088
