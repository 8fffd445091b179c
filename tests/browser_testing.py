"""A real headless Chromium for the viewer's tests: Debian's ``chromium`` driven by Playwright.

``make test`` installs Chromium when it is missing (the Makefile's ``browser`` target); a test that
needs it fails, never skips, without it. Playwright's own browser download is never used: it
launches /usr/bin/chromium with the flags this machine needs (no sandbox as root, no background
networking: the machine has no network and Chromium's own connections only add noise).
"""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # files opened by file:// may read their neighbours (the viewer's media); nothing else changes
    "--allow-file-access-from-files",
]


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise RuntimeError("no Chromium: run `make browser` (apt-get install chromium) before these tests")
    return path


@contextmanager
def browser_page() -> Iterator[object]:
    """A fresh page of a headless Chromium (a new profile each time); yields a Playwright Page whose
    ``errors`` list collects uncaught page errors and ``requests`` every URL it asked for."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.errors = []
            page.requests = []
            page.console_messages = []
            page.on("pageerror", lambda error: page.errors.append(str(error)))
            page.on("request", lambda request: page.requests.append(request.url))
            page.on("console", lambda message: page.console_messages.append(message.text))
            yield page
        finally:
            browser.close()


def file_url(path: Path) -> str:
    return Path(path).resolve().as_uri()
