"""Where Debian's Chromium is, for the browser tests and scripts/webui_screenshots.py."""

import shutil
from pathlib import Path


def find_chromium() -> str | None:
    """The real binary first: Debian's /usr/bin/chromium is a shell wrapper around it."""
    binary = Path("/usr/lib/chromium/chromium")
    if binary.exists():
        return str(binary)
    return shutil.which("chromium") or shutil.which("chromium-browser")
