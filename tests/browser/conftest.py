"""Fixtures of the browser tests: a real llmserve (with an API key, as in tests/server) and Debian's Chromium driven
by Playwright. Playwright never downloads a browser here: it launches the system Chromium by path. Without
Chromium or Playwright the tests skip and say which is missing (`make test` installs Chromium when run as root)."""

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from config.settings import Settings
from model.tokenizer import Tokenizer
from tests.browser.chromium import find_chromium
from tests.server.harness import API_KEY, LiveServer, start_server, stop_server

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

    from tests.browser.page import PageProblems

NO_PLAYWRIGHT = "the playwright package is not installed (pip install -e '.[dev]')"


@pytest.fixture(scope="package")
def browser() -> Iterator["Browser"]:
    sync_api = pytest.importorskip("playwright.sync_api", reason=NO_PLAYWRIGHT)
    executable = find_chromium()
    if executable is None:
        pytest.skip("no Chromium: install Debian's (apt-get install chromium); `make test` does so when run as root")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable)
        yield browser
        browser.close()


@pytest.fixture(scope="package")
def server(browser: "Browser", default_model_path: Path, default_tokenizer: Tokenizer) -> Iterator[LiveServer]:
    """Asks for the browser first, so that without one no model is loaded only to skip."""
    settings = Settings(
        models_dir=default_model_path.parent,
        api_key=API_KEY,
        max_model_len=2048,
        kv_cache_memory=128 * 1024 * 1024,
        max_num_seqs=8,
    )
    from model.engine.engine import Engine

    live, thread = start_server(settings, engine_factory=lambda s: Engine(s, tokenizer=default_tokenizer))
    yield live
    stop_server(live, thread)


@pytest.fixture
def chat(browser: "Browser", server: LiveServer) -> Iterator[tuple["Page", "PageProblems"]]:
    """The chat page with the right API key and short greedy answers, for the tests not about those settings."""
    from tests.browser.page import open_page, ready

    page, problems = open_page(browser, server, apiKey=API_KEY, max_tokens="12", temperature="0")
    ready(page)
    yield page, problems
    page.context.close()
    assert problems.errors == []
