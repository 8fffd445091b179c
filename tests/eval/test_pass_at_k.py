"""pass@k and mean@k, against values derived by hand."""

import pytest

from easyvlm.eval.metrics import group_metrics, pass_at_k, report_ks


def test_pass_at_k_by_hand():
    # n = 4 answers, c = 1 correct: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5;
    # pass@3 = 1 - C(3,3)/C(4,3) = 1 - 1/4 = 0.75; pass@4 = 1 (the correct one is always drawn)
    assert [pass_at_k(4, 1, k) for k in (1, 2, 3, 4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    # n = 5, c = 2, k = 2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7 (the naive 1 - (3/5)^2 = 0.64 is biased low)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_report_ks():
    assert report_ks(1) == [1] and report_ks(4) == [1, 2, 4] and report_ks(6) == [1, 2, 4, 6]


def test_group_metrics_average_over_prompts():
    # prompt A: 1 of 4 correct, prompt B: 4 of 4, prompt C: 0 of 4.
    # mean@4 = (1/4 + 1 + 0) / 3 = 5/12; pass@1 = the same; pass@2 = (0.5 + 1 + 0) / 3 = 0.5;
    # pass@4 = (1 + 1 + 0) / 3 = 2/3
    groups = [[False, True, False, False], [True] * 4, [False] * 4]
    assert group_metrics(groups) == pytest.approx({"mean@4": 5 / 12, "pass@1": 5 / 12, "pass@2": 0.5, "pass@4": 2 / 3})
    with pytest.raises(ValueError, match="same number"):
        group_metrics([[True], [True, False]])


def test_pass_at_k_is_the_chance_over_every_draw_not_the_plug_in():
    # The estimator's definition, counted: of all C(n, k) ways to draw k of the n answers, the share
    # holding a correct one. The plug-in 1 - (1 - c/n)^k draws with replacement and differs from it
    # whenever 0 < c < n and k > 1 (e.g. n=4, c=1, k=2: 0.4375 vs 0.5).
    from itertools import combinations

    for n in range(1, 7):
        for c in range(n + 1):
            answers = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                draws = list(combinations(answers, k))
                counted = sum(any(d) for d in draws) / len(draws)
                assert pass_at_k(n, c, k) == pytest.approx(counted)
                if 0 < c < n and k > 1:
                    assert pass_at_k(n, c, k) != pytest.approx(1 - (1 - c / n) ** k)


def test_report_counts_each_prompt_once_and_names_reward_keys_as_validation_does():
    from easyvlm.eval.run import report

    # 2 answers each: prompt a 1 of 2 correct (accuracy 1, 0), prompt b 2 of 2 (1, 1).
    # mean@2 = (1/2 + 1) / 2 = 0.75 = pass@1; pass@2 = (1 - C(1,2)/C(2,2) + 1) / 2 = (1 + 1) / 2 = 1;
    # val/accuracy_reward = 3/4; val/reward_score = mean(0.9, 0.1, 0.9, 0.8) = 0.675
    rows = [("f1", "a", {"overall": 0.9, "accuracy": 1.0}), ("f1", "a", {"overall": 0.1, "accuracy": 0.0}),
            ("f2", "b", {"overall": 0.9, "accuracy": 1.0}), ("f2", "b", {"overall": 0.8, "accuracy": 1.0})]
    assert report(rows) == pytest.approx({"prompts": 2, "samples": 4, "mean@2": 0.75, "pass@1": 0.75, "pass@2": 1.0,
                                          "val/reward_score": 0.675, "val/accuracy_reward": 0.75})
    # one file's rows: prompt b alone, both answers correct
    assert report(rows[2:]) == pytest.approx({"prompts": 1, "samples": 2, "mean@2": 1.0, "pass@1": 1.0, "pass@2": 1.0,
                                              "val/reward_score": 0.85, "val/accuracy_reward": 1.0})
