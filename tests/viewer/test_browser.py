"""The viewer's pages in a real headless Chromium: hostile model output stays text.

A policy can learn to emit markup; the page must show it, not run it. (The pages of a real run are
opened in tests/trainer/test_viewer_e2e.py.)
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from easyvlm.viewer.pages import write_page
from easyvlm.viewer.records import RolloutSample
from browser_testing import browser_page, file_url

HOSTILE = [
    "<script>window.pwned = 'script'</script>",
    '<img src=x onerror="window.pwned = \'onerror\'">',
    '<a href="javascript:window.pwned=\'link\'">click me</a>',
    "</script><script>window.pwned = 'breakout'</script>",
]


def sample(index: int, response: str, image: str) -> RolloutSample:
    return RolloutSample(
        step=1, split="train", uid="u<b>0</b>", index=index, prompt="<h1>prompt</h1>", images=[image], videos=[],
        response=response, ground_truth="<i>x</i>", reward=float(index), scores={"overall": float(index), "<b>key</b>": 1.0},
        advantage=0.5, response_length=1, tokens=[response], logprobs=[-0.5],
    )


def test_hostile_responses_render_as_text_and_run_nothing(tmp_path: Path):
    (tmp_path / "media").mkdir()
    Image.new("RGB", (8, 8), "green").save(tmp_path / "media" / "g.png")
    page_path = write_page([sample(i, text, "media/g.png") for i, text in enumerate(HOSTILE)], tmp_path, "step_1", "<b>title</b>")
    with browser_page() as page:
        page.goto(file_url(page_path))
        page.wait_for_selector(".sample")
        for link in page.query_selector_all("a"):  # our only link is "all steps"; click whatever is there
            if "javascript" in (link.get_attribute("href") or ""):
                link.click()
        shown = page.eval_on_selector_all(".response", "nodes => nodes.map(n => n.textContent)")
        assert shown == HOSTILE  # verbatim, as text
        assert page.evaluate("window.pwned === undefined")
        assert page.evaluate("document.querySelectorAll('script').length") == 2  # the data and the page's own
        assert page.evaluate("document.querySelectorAll('img.thumb').length") == 1  # only the prompt's image
        assert page.eval_on_selector("h2", "n => n.textContent").startswith("prompt 1")
        assert page.eval_on_selector("pre.prompt", "n => n.textContent") == "<h1>prompt</h1>"
        assert page.evaluate("document.querySelector('img.thumb').naturalWidth") == 8
        assert page.errors == []
        # nothing but the page and its own files was requested: no network
        assert all(url.startswith("file://") for url in page.requests), page.requests


def test_the_index_prints_counts_as_integers_and_means_to_three_decimals(tmp_path: Path):
    # two pages: step 1 with 4 samples in 2 groups (rewards 0, 1, 2, 3: mean 1.5), step 2 with 1 sample
    (tmp_path / "media").mkdir()
    Image.new("RGB", (8, 8), "green").save(tmp_path / "media" / "g.png")
    write_page([sample(i, "red", "media/g.png") for i in range(4)], tmp_path, "step_1", "step 1")
    write_page([sample(0, "red", "media/g.png")], tmp_path, "step_2", "step 2")
    with browser_page() as page:
        page.goto(file_url(tmp_path / "index.html"))
        page.wait_for_selector("tr.page")
        headers = page.eval_on_selector_all("#pages th", "nodes => nodes.map(n => n.textContent)")
        rows = page.eval_on_selector_all("tr.page", "rows => rows.map(r => [...r.cells].map(c => c.textContent))")
        by_column = [dict(zip(headers, row)) for row in rows]
        assert [(r["step"], r["groups"], r["samples"]) for r in by_column] == [("1", "1", "4"), ("1", "1", "1")]
        assert by_column[0]["mean reward"] == "1.500" and by_column[1]["mean reward"] == "0.000"
        assert by_column[0]["format failures"].isdigit()
        assert page.errors == []
