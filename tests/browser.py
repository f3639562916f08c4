"""Headless Chromium for the dashboard tests: Debian's ``chromium`` driven through
``chromium-driver`` by selenium (nothing downloaded at run time)."""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "google-chrome")
DRIVER_CANDIDATES = ("chromedriver", "chromium-driver")


def _which(names) -> str | None:
    for name in names:
        path = shutil.which(name) or (f"/usr/lib/chromium/{name}" if os.path.exists(f"/usr/lib/chromium/{name}") else None)
        if path:
            return path
    return None


def headless_chromium(width: int = 1400, height: int = 1100):
    """A selenium ``WebDriver`` on headless Chromium with the network log enabled
    (``driver.get_log("performance")``). Skips the test when the browser is missing,
    unless ``TICKSERVE_REQUIRE_BROWSER=1`` (CI), where that is a failure."""
    browser, driver_path = _which(CHROMIUM_CANDIDATES), _which(DRIVER_CANDIDATES)
    if not (browser and driver_path):
        message = ("headless browser tests need Debian's chromium and chromium-driver "
                   "(apt-get install chromium chromium-driver)")
        if os.environ.get("TICKSERVE_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium must not fetch a browser or driver
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--no-first-run", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-default-apps", "--metrics-recording-only", "--no-default-browser-check"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
