"""bench/cluster_model.py against hand-derived step times and its staleness bound."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from cluster_model import Setup, calibrate, long_tail_lengths, simulate  # noqa: E402


def test_sync_step_is_generation_plus_training_plus_sync():
    s = Setup(engines=1, trainer_gpus=1, staleness=0, prompts=4, n=2, prompt_len=10, step_floor_s=0.01,
              step_per_seq_s=0.001, max_batch=8, prefill_s_per_token=0.001, train_tok_s=100.0, sync_s=0.5,
              load_s=0.2, measure=5)
    r = simulate(s, [20])
    # k = 0: the trainer at version p may have (p + 1) * B groups admitted, all trained by step p + 1,
    # so nothing overlaps. A step from one publish to the next:
    #   engine loads the new weights            load_s                       = 0.2
    #   prefills the B = 4 prompts of 10 tokens 4 * 10 * 0.001               = 0.04
    #   20 decode steps of b = B * n = 8        20 * (0.01 + 0.001 * 8)      = 0.36
    #   trains B * n * (prompt + response)      8 * (10 + 20) / (100 * 1)    = 2.4
    #   pushes the weights                      sync_s                       = 0.5
    # = 3.5 s (gen 0.6 incl. the load, train 2.4, sync 0.5); the first step has no load: 3.3 s
    assert r.step_times[0] == pytest.approx(3.3)
    assert r.s_per_step == pytest.approx(3.5) and r.s_per_step_mean == pytest.approx(3.5)
    assert r.trainer_idle == pytest.approx(0.6 / 3.5)  # waits for load + prefill + decode
    assert r.engine_idle == pytest.approx(1 - 0.36 / 3.5)  # decodes 0.36 s of each 3.5
    assert r.mean_batch == pytest.approx(8)
    assert r.staleness_max_all == 0 and r.partial_frac == 0


@pytest.mark.parametrize("train_tok_s, sync_s, load_s, period", [
    (160.0, 0.2, 0.0, 1.0),  # engine-bound: G = 1.0 > T + S = 0.5 + 0.2
    (160.0, 0.2, 0.3, 1.3),  # ... the engine loads between its batches: G + load_s
    (40.0, 0.2, 0.0, 2.2),  # trainer-bound: T + S = 2.0 + 0.2 > G; the push serialises with training
    (40.0, 0.7, 0.3, 2.7),  # ... the load hides behind it: max(G + load_s, T + S)
])
def test_one_step_stale_step_is_max_of_generation_and_training(train_tok_s, sync_s, load_s, period):
    # One engine holding exactly one batch (max_batch = B * n), constant lengths, no prefill,
    # t_step = a: generating a batch takes G = L * a = 10 * 0.1 = 1.0 s; training one takes
    # T = B * n * L / train_tok_s = 80 / train_tok_s. Let tau_j be when step j starts training and
    # phi_j when batch j is generated. k = 1 lets the engine run one batch ahead: batch j + 2 is
    # admitted once version j is published (tau_j + T + S), the engine also needing to be free
    # (phi_{j+1}) and loaded, so phi_{j+2} = max(phi_{j+1}, tau_j + T + S) + load_s + G and
    # tau_{j+1} = max(tau_j + T + S, phi_{j+1}). If G + load_s >= T + S the engine never waits
    # for a version and phi_j = G + (j - 1)(G + load_s), tau_j = phi_j; else tau_{j+1} = tau_j + T + S
    # (phi_{j+1} = tau_{j-1} + T + S + load_s + G <= tau_j + T + S). Period: max(G + load_s, T + S).
    s = Setup(engines=1, trainer_gpus=1, staleness=1, prompts=4, n=2, prompt_len=0, step_floor_s=0.1,
              step_per_seq_s=0.0, max_batch=8, prefill_s_per_token=0.0, train_tok_s=train_tok_s,
              sync_s=sync_s, load_s=load_s, measure=6)
    r = simulate(s, [10])
    assert r.s_per_step == pytest.approx(period) and r.s_per_step_mean == pytest.approx(period)
    assert r.staleness_mean == 1 and r.staleness_max == 1  # every batch after the first is one update old


@pytest.mark.parametrize("admission, staleness", [("demand", 1), ("eager", 2)])
def test_demand_admission_keeps_a_fast_engine_one_step_ahead(admission, staleness):
    # One engine, constant lengths, t_step = a = 0.1 s whatever the batch (c = 0), room for 3 batches
    # (max_batch = 3 * B * n), no prefill, load or push cost: generating a batch takes G = L * a =
    # 1.0 s, training it T = B * n * L / train_tok_s = 80 / 40 = 2.0 s, plus S = 0.2 s: the engine is
    # faster than the trainer. k = 2: at version p at most (p + 3) * B groups admitted in all.
    # Eager: 3 batches admitted at t = 0, all complete at G; then one batch per publish (the bound
    # rises by B). Step 1 (t = G) trains batch 1, step 2 (at version 1) batch 2 (admitted at 0),
    # step 3 (version 2) batch 3 (0), step 4 (version 3) batch 4 (admitted at the publish of 1), ...:
    # staleness 2 from step 3 on, the engine k steps ahead.
    # Demand (easyvlm's _may_admit): a batch only while < B groups generate and < B complete ones
    # wait. t = 0: batch 1 (version 0). t = G: it completes (B waiting, no admission) and step 1
    # takes it; nothing waits or generates, so batch 2 is admitted at version 0 and completes at
    # 2G < G + T + S. Then B wait again: nothing more is admitted until step 2 takes batch 2 at the
    # publish of version 1 (staleness 1) and batch 3 is admitted at version 1, complete G later, long
    # before the publish of version 2, when step 3 takes it (staleness 1); and so on: staleness 1,
    # one batch ahead, never k.
    # Both: the trainer never waits after step 1, so a step takes T + S = 2.2 s (the first G + T + S
    # = 3.2 s), and the engine decodes one batch of B * n = 8 sequences per step.
    s = Setup(engines=1, trainer_gpus=1, staleness=2, prompts=4, n=2, prompt_len=0, step_floor_s=0.1,
              step_per_seq_s=0.0, max_batch=24, prefill_s_per_token=0.0, train_tok_s=40.0, sync_s=0.2,
              load_s=0.0, measure=6, admission=admission)
    r = simulate(s, [10])
    assert r.step_times[0] == pytest.approx(3.2)
    assert r.s_per_step == pytest.approx(2.2) and r.s_per_step_mean == pytest.approx(2.2)
    assert r.trainer_idle == pytest.approx(0) and r.engine_idle == pytest.approx(1 - 1.0 / 2.2)
    assert r.mean_batch == pytest.approx(8)
    assert r.staleness_mean == staleness and r.staleness_max == staleness and r.staleness_max_all == staleness


def _random_setup(rng: np.random.Generator, **fixed) -> tuple[Setup, np.ndarray]:
    n = int(rng.integers(1, 5))
    setup = Setup(engines=int(rng.integers(1, 5)), trainer_gpus=int(rng.integers(1, 5)),
                  staleness=int(rng.integers(0, 5)), partial=bool(rng.integers(2)), prompts=int(rng.integers(1, 7)),
                  n=n, prompt_len=int(rng.integers(0, 50)), step_floor_s=float(rng.uniform(0.001, 0.02)),
                  step_per_seq_s=float(rng.uniform(0, 0.002)), max_batch=n * int(rng.integers(1, 9)),
                  prefill_s_per_token=float(rng.uniform(0, 1e-3)), recompute_kv=bool(rng.integers(2)),
                  train_tok_s=float(rng.uniform(20, 2000)), sync_s=float(rng.uniform(0, 0.5)),
                  load_s=float(rng.uniform(0, 0.3)), measure=6, seed=int(rng.integers(1000)), **fixed)
    return setup, rng.integers(1, 300, size=int(rng.integers(1, 6)))


@pytest.mark.parametrize("admission", ["demand", "eager"])
def test_staleness_never_exceeds_k(admission):
    rng = np.random.default_rng(0)
    for _ in range(40):
        setup, lengths = _random_setup(rng, admission=admission)
        r = simulate(setup, lengths)
        assert r.staleness_max_all <= setup.staleness, (setup, lengths)
        assert r.overflows == 0


def test_the_rule_without_lookahead_can_exceed_k():
    # The admission bound plus "take every group started at version <= p - k, the rest by completion
    # order" alone: fast new groups are trained ahead of slow old ones, so at k = 2 an old group can
    # find the batch already full of groups that must be taken. Found by a random search, with eager
    # admission; with demand admission no search found one (docs/cluster_model.md).
    setup = Setup(engines=1, trainer_gpus=1, staleness=2, partial=True, prompts=4, n=2, prompt_len=0,
                  step_floor_s=0.01, step_per_seq_s=0.0, max_batch=12, prefill_s_per_token=0.0,
                  train_tok_s=290.0, sync_s=0.0, load_s=0.0, measure=8, seed=70, admission="eager")
    naive = simulate(Setup(**{**setup.__dict__, "lookahead": False}), [10, 80])
    assert naive.overflows > 0 and naive.staleness_max_all > setup.staleness
    assert simulate(setup, [10, 80]).staleness_max_all <= setup.staleness


@pytest.mark.parametrize("admission", ["demand", "eager"])
@pytest.mark.parametrize("engines, trainers", [(4, 4), (8, 8)])
def test_partial_rollouts_with_long_tails(engines, trainers, admission):
    # most responses around L = 256, 5 % at 8 L; the example setup of docs/cluster_model.md but
    # B = 32 prompts for speed. Without partial rollouts an engine drains its tails before it takes
    # new weights and prompts; with them it switches at once (re-prefilling its sequences). Mean
    # s/step with / without, k = 1, 2, 4, eager: 4+4: 0.95, 1.00, 1.00; 8+8: 1.008, 0.93, 1.00;
    # demand: 4+4 the same; 8+8: 1.007, 1.019, 1.00. Not a law of the model: with 2 engines + 6
    # trainer GPUs at k = 2 partial rollouts are 7 % slower (docs/cluster_model.md), and there the
    # engines are idle more, not less. Demand, 8+8, k = 2: the engines are idle 7.0 % without partial
    # rollouts (eager: 26 %) and 7.1 % with them, so there is no idle time left for them to remove.
    lengths = long_tail_lengths(256)
    for k in (1, 2, 4):
        base = dict(engines=engines, trainer_gpus=trainers, staleness=k, prompts=32, measure=30, admission=admission)
        without, with_partial = simulate(Setup(**base), lengths), simulate(Setup(**base, partial=True), lengths)
        assert with_partial.s_per_step_mean <= without.s_per_step_mean * 1.02, k
        if (admission, engines, k) == ("demand", 8, 2):
            assert with_partial.engine_idle < 0.08 and without.engine_idle < 0.08
        else:
            assert with_partial.engine_idle < without.engine_idle, k
        assert with_partial.partial_frac > 0 and without.partial_frac == 0


def test_calibration_recovers_the_speeds_of_a_log(tmp_path):
    # a log written by the model's own equations: gen = a * max_len + c * response tokens per engine,
    # trainer passes = tokens / train_tok_s, the rest of the step 0.1 s
    a, c, tok_s, rows = 0.02, 0.001, 5000.0, []
    for step, (mean, top) in enumerate([(100, 400), (150, 300), (120, 800), (200, 500)], start=1):
        samples, prompt = 64, 50
        tokens = samples * (prompt + mean)
        gen, train = a * top + c * mean * samples, tokens / tok_s
        rows.append({"step": step, "timing_s/gen": gen, "timing_s/update_actor": train / 2, "timing_s/old": train / 4,
                     "timing_s/ref": train / 4, "timing_s/step": gen + train + 0.1, "perf/total_num_tokens": tokens,
                     "prompt_length/mean": prompt, "response_length/mean": mean, "response_length/max": top,
                     "response_length/min": 10})
    log = tmp_path / "experiment_log.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in [{"step": 0, "val/reward_score": 0.1}, *rows]))
    overrides, lengths, medians = calibrate(log, n=8)
    assert overrides["step_floor_s"] == pytest.approx(a) and overrides["step_per_seq_s"] == pytest.approx(c)
    assert overrides["train_tok_s"] == pytest.approx(tok_s) and overrides["sync_s"] == pytest.approx(0.1)
    assert overrides["prompts"] == 8 and overrides["prompt_len"] == 50
    # no rollout records: per step (first skipped) one sample at the max, one at the min, 62 at the rest
    assert len(lengths) == 3 * 64 and lengths.max() == 800 and lengths.min() == 10
