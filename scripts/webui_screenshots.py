"""The README's screenshots of the chat page, desktop and phone width, taken with Playwright and Debian's Chromium
against a running server (`make serve`): one greedy answer, then docs/webui-desktop.png and docs/webui-phone.png.

    .venv/bin/python scripts/webui_screenshots.py [--url http://127.0.0.1:8000] [--api-key KEY]
"""

import argparse
import json
import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.browser.chromium import find_chromium  # noqa: E402

PROMPT = "How do I reverse a string in Python? Show a short example."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    args = parser.parse_args()
    executable = find_chromium()
    if executable is None:
        sys.exit("no Chromium: apt-get install chromium")
    args.out.mkdir(exist_ok=True)
    settings = json.dumps({"apiKey": args.api_key, "temperature": "0", "max_tokens": "160"})
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable)
        desktop = browser.new_context(viewport={"width": 1280, "height": 800})
        desktop.add_init_script(f"localStorage.setItem('llmserve.settings.v1', {json.dumps(settings)})")
        page = desktop.new_page()
        page.goto(args.url + "/")
        page.wait_for_function("document.getElementById('model-name').textContent")  # the model list answered
        page.fill("#prompt", PROMPT)
        page.press("#prompt", "Enter")
        page.locator("#messages article.assistant:not([data-state=streaming])").wait_for(timeout=300_000)
        page.fill("#prompt", "And a list?")  # shows the composer in use
        page.screenshot(path=args.out / "webui-desktop.png")

        phone = browser.new_context(
            viewport={"width": 390, "height": 844},
            device_scale_factor=2,
            is_mobile=True,
            has_touch=True,
            storage_state=desktop.storage_state(),
        )  # the same conversation
        page = phone.new_page()
        page.goto(args.url + "/")
        page.wait_for_function("document.getElementById('model-name').textContent")
        page.screenshot(path=args.out / "webui-phone.png")
        browser.close()
    for name in ("webui-desktop.png", "webui-phone.png"):
        print(args.out / name, (args.out / name).stat().st_size // 1024, "KiB")


if __name__ == "__main__":
    main()
