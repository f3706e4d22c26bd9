"""Headless Chromium for tests: Debian's ``chromium`` and ``chromium-driver``, driven by Selenium.

Nothing is ever downloaded: the driver and the browser are named explicitly (so Selenium Manager
never runs, and ``SE_OFFLINE`` forbids it anyway) and the browser's own background traffic is
off. Without Chromium the browser tests skip — unless ``MESHNET_REQUIRE_BROWSER=1`` (CI sets it),
where a missing browser is a failure.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from selenium.webdriver.chrome.webdriver import WebDriver

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WINDOW = (1400, 1800)  # tall enough for the whole dashboard in one screenshot
ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--mute-audio",
    f"--window-size={WINDOW[0]},{WINDOW[1]}",
]


def _unavailable(reason: str) -> None:
    if os.environ.get("MESHNET_REQUIRE_BROWSER") == "1":
        pytest.fail(f"a browser is required here (MESHNET_REQUIRE_BROWSER=1) but {reason}")
    pytest.skip(f"no headless browser: {reason} (apt-get install chromium chromium-driver)")


@contextlib.contextmanager
def chromium() -> Iterator[WebDriver]:
    """A fresh headless Chromium with an empty profile that records the page's console; always quit."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not path.is_file():
            _unavailable(f"{path} is missing")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("the selenium package is not installed (pip install -e '.[dev]')")
        raise
    with tempfile.TemporaryDirectory(prefix="meshnet-chromium-") as profile, pytest.MonkeyPatch.context() as mp:
        mp.setenv("SE_OFFLINE", "true")
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for arg in [*ARGS, f"--user-data-dir={profile}"]:
            options.add_argument(arg)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        service = Service(executable_path=str(CHROMEDRIVER), log_output=os.devnull)
        driver = webdriver.Chrome(service=service, options=options)
        try:
            driver.set_page_load_timeout(30)
            driver.set_script_timeout(30)
            yield driver
        finally:
            driver.quit()


def console_errors(driver: WebDriver) -> list[str]:
    """The page's console errors since the last call (uncaught exceptions, failed loads, CSP refusals)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
