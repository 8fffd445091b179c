"""The rollout viewer of a real run, opened in a real headless Chromium (issue 16's check).

A 3-step run with ``trainer.rollout_log_freq=1`` and a validation at the end writes
``rollouts/step_{1,2,3}`` and ``rollouts/val_step_3`` (JSONL + HTML) and ``rollouts/index.html``.
The browser opens the index, follows its link to a step page, and the test reads the rendered DOM:
every image loaded, each group shows its n samples with the rewards of the JSONL. A screenshot of
the page is saved next to it (``rollouts/step_2.png``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from browser_testing import browser_page, file_url

from easyvlm.trainer.main import main

N = 4  # worker.rollout.n of e2e_base_args
# samples of a prompt score differently (the synthetic reward scores the untrained model 0 throughout)
REWARD = Path(__file__).parent / "e2e_reward.py"


@pytest.fixture(scope="class")
def viewer_run(e2e_ray, e2e_base_args, tmp_path_factory):
    save = tmp_path_factory.mktemp("viewer_run")
    main([*e2e_base_args, f"worker.reward.reward_function={REWARD}:compute_score",
          "trainer.max_steps=3", "trainer.rollout_log_freq=1", "trainer.val_freq=3",
          "trainer.logger=[file]", f"trainer.save_checkpoint_path={save}"])
    return save


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class TestViewerOfARun:
    def test_each_step_and_the_validation_get_a_page_matching_the_logged_metrics(self, viewer_run):
        root = viewer_run / "rollouts"
        names = sorted(p.stem for p in root.glob("*.html"))
        assert names == ["index", "step_1", "step_2", "step_3", "val_step_3"]
        log = {row["step"]: row for row in read_jsonl(viewer_run / "experiment_log.jsonl")}
        for step in (1, 2, 3):
            rows = read_jsonl(root / f"step_{step}.jsonl")
            assert len(rows) == 4 * N and {r["step"] for r in rows} == {step}  # 4 prompts x n samples
            # the page holds the very samples the step trained on: their mean reward is the logged one
            assert sum(r["reward"] for r in rows) / len(rows) == pytest.approx(log[step]["reward/overall"], abs=1e-6)
            for r in rows:
                assert len(r["tokens"]) == len(r["logprobs"]) == r["response_length"] >= 1
                assert all(lp <= 0 for lp in r["logprobs"]) and len(r["images"]) >= 1
            for uid in {r["uid"] for r in rows}:  # GRPO: above the group's mean reward <=> positive advantage
                group = [r for r in rows if r["uid"] == uid]
                mean = sum(r["reward"] for r in group) / N
                for r in group:
                    assert (r["advantage"] > 1e-6) == (r["reward"] > mean + 1e-9) and (abs(r["advantage"]) < 1e-6) == (abs(r["reward"] - mean) < 1e-9)
        val = read_jsonl(root / "val_step_3.jsonl")
        assert {r["split"] for r in val} == {"val"} and all(r["advantage"] is None for r in val)
        assert sum(r["scores"]["accuracy"] for r in val) / len(val) == pytest.approx(log[3]["val/accuracy_reward"], abs=1e-6)


    def test_the_browser_shows_every_image_and_each_groups_samples_and_rewards(self, viewer_run):
        root = viewer_run / "rollouts"
        rows = read_jsonl(root / "step_2.jsonl")
        with browser_page() as page:
            page.goto(file_url(root / "index.html"))
            listed = page.eval_on_selector_all("tr.page td:first-child", "cells => cells.map(c => c.textContent)")
            assert listed == ["training rollouts, step 1", "training rollouts, step 2", "training rollouts, step 3", "validation, step 3"]
            page.click("text=training rollouts, step 2")
            page.wait_for_load_state("load")
            assert page.url.endswith("/step_2.html")
            images = page.eval_on_selector_all("img.thumb", "imgs => imgs.map(i => [i.complete, i.naturalWidth])")
            assert images and all(complete and width > 0 for complete, width in images)
            assert len(images) == sum(len(r["images"]) for r in rows if r["index"] == 0)  # one set per prompt
            shown = page.eval_on_selector_all(
                ".group", "groups => groups.map(g => [g.dataset.uid, [...g.querySelectorAll('.sample .head')].map(h => h.textContent)])"
            )
            assert [uid for uid, _ in shown] == list(dict.fromkeys(r["uid"] for r in rows))
            assert 0 < sum(r["reward"] for r in rows) < len(rows)  # right and wrong samples: the checks below bite
            for uid, heads in shown:
                expected = [r["reward"] for r in rows if r["uid"] == uid]
                assert len(heads) == N
                assert [float(re.search(r"reward (-?[\d.]+)", h).group(1)) for h in heads] == pytest.approx(expected, abs=5e-4)
            # the filters act: "correct" keeps exactly the samples the JSONL scores accuracy 1
            page.select_option("#filter", "correct")
            visible = page.eval_on_selector_all(".sample", "nodes => nodes.filter(n => n.offsetParent !== null).length")
            assert visible == sum(r["scores"]["accuracy"] >= 1 for r in rows)
            page.select_option("#filter", "all")
            page.screenshot(path=str(root / "step_2.png"), full_page=True)
            assert page.errors == [] and all(url.startswith("file://") for url in page.requests)
        assert (root / "step_2.png").stat().st_size > 10_000
