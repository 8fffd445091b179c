"""The rollout viewer's files: a JSONL and a static HTML page per step, and an index across steps
(docs/viewer.md). Nothing shown is ever parsed as HTML: records travel as escaped JSON and go into
the page with ``textContent``, under a strict Content-Security-Policy (docs/viewer.md, "Safety")."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

from easyvlm.viewer.records import RolloutSample, _finite, is_correct, is_format_failure, sample_to_json

PAGES_FILE = "pages.jsonl"
ASSETS = Path(__file__).parent / "assets"


def write_page(samples: Sequence[RolloutSample], root: Path, name: str, title: str) -> Path:
    """Write ``root/<name>.jsonl`` and ``.html`` and rewrite ``root/index.html``, each atomically;
    returns the HTML page's path."""
    root.mkdir(parents=True, exist_ok=True)
    _write(root / f"{name}.jsonl", "".join(sample_to_json(s) + "\n" for s in samples))
    page = root / f"{name}.html"
    _write(page, render_page(samples, title))
    summary = page_summary(samples, name, title)
    with open(root / PAGES_FILE, "a") as f:
        f.write(json.dumps(summary) + "\n")
    _write(root / "index.html", render_index(read_page_summaries(root)))
    return page


def page_summary(samples: Sequence[RolloutSample], name: str, title: str) -> dict[str, Any]:
    """The index's line for a page: counts and means over its samples."""
    count = len(samples)
    groups = {s.uid for s in samples}
    mean = (lambda values: sum(values) / len(values) if values else None)
    return {
        "name": name,
        "title": title,
        "step": samples[0].step if samples else None,
        "split": samples[0].split if samples else None,
        "groups": len(groups),
        "samples": count,
        "reward": mean([s.reward for s in samples]),
        "accuracy": mean([1.0 if is_correct(s.scores) else 0.0 for s in samples]),
        "format_failures": sum(is_format_failure(s.scores) for s in samples),
        "mean_length": mean([s.response_length for s in samples]),
    }


def read_page_summaries(root: Path) -> list[dict[str, Any]]:
    """The pages of ``root``, one per name (the last written wins: a resumed run rewrites steps), by step,
    evaluations last."""
    path = root / PAGES_FILE
    by_name: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                if (root / f"{entry['name']}.html").exists():
                    by_name[entry["name"]] = entry
    order = {"train": 0, "val": 0}
    return sorted(by_name.values(), key=lambda e: (order.get(e["split"], 1), e["step"] if e["step"] is not None else -1, e["name"]))


# ------------------------------------------------------------------------------- rendering
def render_page(samples: Sequence[RolloutSample], title: str) -> str:
    # the judgements the filters use are made here, once, by the same functions as the index's
    rows = [{**_as_dict(s), "correct": is_correct(s.scores), "format_failure": is_format_failure(s.scores)} for s in samples]
    data = {"title": title, "samples": _finite(rows)}
    return _render("page", title, data)


def render_index(pages: list[dict[str, Any]]) -> str:
    return _render("index", "easyvlm rollouts", {"title": "easyvlm rollouts", "pages": _finite(pages)})


def _render(kind: str, title: str, data: dict[str, Any]) -> str:
    style = (ASSETS / "viewer.css").read_text()
    script = (ASSETS / "viewer.js").read_text()
    policy = "; ".join(
        [
            "default-src 'none'",
            f"script-src '{_sha256(script)}'",
            f"style-src '{_sha256(style)}'",
            # the page's own media files: relative paths (file: when opened from disk)
            "img-src 'self' file: data:",
            "base-uri 'none'",
            "form-action 'none'",
        ]
    )
    return (
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{policy}\">\n"
        f"<title>{_escape_html(title)}</title>\n"
        f"<style>{style}</style>\n</head>\n"
        f"<body data-kind=\"{kind}\"><noscript>This page needs JavaScript to show the rollouts.</noscript>\n"
        f"<script type=\"application/json\" id=\"data\">{script_json(data)}</script>\n"
        f"<script>{script}</script>\n</body></html>\n"
    )


def script_json(data: Any) -> str:
    """JSON safe inside a ``<script>`` element: ``<``, ``>``, ``&`` and JS line separators as ``\\uXXXX``."""
    text = json.dumps(data, ensure_ascii=False)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escaped)
    return text


def _escape_html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _sha256(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


def _as_dict(sample: RolloutSample) -> dict[str, Any]:
    return dataclasses.asdict(sample)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
