import math

import torch
from torch.testing import assert_close

from easyvlm.algorithms.masked import masked_mean, masked_sum, masked_whiten

NAN = float("nan")


def test_masked_sum_and_mean_ignore_nan_at_masked_positions():
    values = torch.tensor([[1.0, 2.0, NAN], [4.0, NAN, NAN], [NAN, NAN, NAN]])
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    # valid: 1, 2 | 4 | (none)  -> sum 7 over 3 tokens
    assert_close(masked_sum(values, mask), torch.tensor(7.0))
    assert_close(masked_mean(values, mask), torch.tensor(7.0 / 3))
    # per row: (1+2)/2 = 1.5, 4/1 = 4, empty row -> 0 (not NaN)
    assert_close(masked_mean(values, mask, dim=-1), torch.tensor([1.5, 4.0, 0.0]))


def test_masked_whiten_uses_population_variance_over_valid_tokens():
    values = torch.tensor([[1.0, 2.0, 3.0], [5.0, 1e6, NAN], [NAN, NAN, NAN]])
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    # valid 1, 2, 3, 5: mean 11/4 = 2.75; squared deviations 3.0625, 0.5625, 0.0625, 5.0625
    # -> population var 8.75 / 4 = 2.1875, std 1.479020
    std = math.sqrt(2.1875 + 1e-8)
    expected = torch.tensor([[-1.75 / std, -0.75 / std, 0.25 / std], [2.25 / std, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert_close(masked_whiten(values, mask), expected)
