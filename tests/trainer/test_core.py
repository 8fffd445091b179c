import torch

from easyvlm.trainer.core import count_tokens, group_ids_from_uids, groups_in_range, place_seq_rewards, rows_of_groups


def test_group_ids_number_by_first_appearance():
    assert group_ids_from_uids(["b", "b", "a", "a", "c"]).tolist() == [0, 0, 1, 1, 2]


def test_place_seq_rewards_on_last_valid_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    rewards = torch.tensor([0.5, -1.0, 7.0, 2.0])
    # lengths 3, 1, 0, 4 -> positions 2, 0, none, 3; the empty response gets nothing
    expected = torch.tensor([[0, 0, 0.5, 0], [-1.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 2.0]])
    torch.testing.assert_close(place_seq_rewards(rewards, mask), expected)


def test_groups_in_range_drops_all_right_and_all_wrong_groups():
    uids = ["p", "p", "q", "q", "r", "r"]
    acc = [1, 1, 0, 1, 0, 0]
    # means: p = 1.0 (all right), q = 0.5, r = 0.0 (all wrong) -> only q carries signal
    assert groups_in_range(uids, acc, 0.01, 0.99) == ["q"]
    assert rows_of_groups(uids, ["q", "r"]) == [2, 3, 4, 5]


def test_count_tokens():
    assert count_tokens(torch.tensor([[0, 1, 1], [1, 1, 1]])) == 5
