"""What the browser tests share: Debian's chromium, driven by Playwright, and where screenshots go."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(__file__).parent / "artifacts"


def require_chromium():
    """Playwright's sync API, or skip the calling test module (fail under CI) when the browser is missing."""
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            raise RuntimeError(f"{CHROMIUM} is missing: CI must `apt-get install chromium` for the browser tests")
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)", allow_module_level=True)
    return pytest.importorskip("playwright.sync_api")
