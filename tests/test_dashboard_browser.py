"""/dashboard in a real headless Chromium against a real server on the tiny model:
values move with load and agree with /scheduler/stats, the engine is shown down after
``kill -9`` and up again after the supervisor restarts it, and the page talks to no
host but the server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.browser import headless_chromium
from tests.procs import ProcessGroup, child_running, free_port, stats, wait_for, wait_healthy

pytestmark = pytest.mark.slow

LOAD = {"prompt": "count slowly", "max_tokens": 400, "ignore_eos": True, "stream": True}
STREAMS = 6


@pytest.fixture
def served(tmp_path, tiny_model_dir):
    group = ProcessGroup(tmp_path)
    port = free_port()
    run_dir = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))
    proc = group.spawn(["-m", "shared.cli", "serve", "--model", str(tiny_model_dir), "--port", str(port),
                        "--device", "cpu", "--torch-threads", "1", "--data-parallel-size", "1", "--run-dir", str(run_dir),
                        "--log-level", "warning"], "serve")
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, 120)
    yield proc, base
    group.close()
    shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def browser():
    driver = headless_chromium()
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def text(driver, element_id: str) -> str:
    return driver.execute_script(f"return document.getElementById({element_id!r}).textContent")


def number(driver, element_id: str) -> float:
    return float(text(driver, element_id))


def engine_state(driver) -> tuple[str, str]:
    """(state, engine id) of the engine the page shows up, else of its newest row."""
    rows = driver.execute_script(
        "return [...document.querySelectorAll('#engines tbody tr')]"
        ".map(r => [r.querySelector('.engine-state').textContent, r.dataset.engine])")
    up = [r for r in rows if r[0] == "up"]
    return tuple(up[0] if up else (rows[-1] if rows else ("none", "")))


def load(base: str, stop: threading.Event, errors: list) -> None:
    i = 0
    while not stop.is_set():
        i += 1
        try:
            with httpx.stream("POST", f"{base}/v1/completions", json={**LOAD, "user": f"s{i % 3}"},
                              timeout=60) as resp:
                for _ in resp.iter_lines():
                    if stop.is_set():
                        break
        except Exception as exc:  # noqa: BLE001 - the engine is killed mid-test on purpose
            errors.append(repr(exc))
            time.sleep(0.2)


def test_dashboard_follows_load_and_engine_restart_without_leaving_the_host(served, browser):
    proc, base = served
    browser.get(f"{base}/dashboard")
    wait_for(lambda: number(browser, "updates") >= 2 and engine_state(browser)[0] == "up", 30, 0.2,
             "dashboard receiving stats with the engine up")
    assert text(browser, "v-num_active") == "0"
    first_engine = engine_state(browser)[1]
    assert first_engine == stats(base)["engine_id"]

    stop, errors = threading.Event(), []
    threads = [threading.Thread(target=load, args=(base, stop, errors), daemon=True) for _ in range(STREAMS)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: number(browser, "v-num_active") == STREAMS and number(browser, "v-output_tokens_per_s") > 0,
                 60, 0.2, "page showing the load")

        def agrees() -> bool:
            shown_active = number(browser, "v-num_active")
            shown_rate = number(browser, "v-output_tokens_per_s")
            engine = stats(base)
            rate = engine["window"]["output_tokens_per_s"]
            return (abs(shown_active - engine["num_active"]) <= 1
                    and abs(shown_rate - rate) <= 0.25 * rate + 1)

        wait_for(agrees, 20, 0.3, "page values within tolerance of /scheduler/stats")
        assert text(browser, "v-ttft_p50") != "–" and text(browser, "v-itl_p50") != "–"
        sessions = browser.execute_script(
            "return [...document.querySelectorAll('#sessions tbody tr td:first-child')].map(td => td.textContent)")
        assert set(sessions) & {"s0", "s1", "s2"}

        pid = child_running(proc.popen.pid, "engine_proc")
        assert pid
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: text(browser, "conn") == "engine down" and engine_state(browser)[0] != "up",
                 15, 0.1, "page showing the engine down")
        wait_for(lambda: engine_state(browser)[0] == "up" and engine_state(browser)[1] != first_engine,
                 90, 0.2, "page showing the restarted engine up")
        restarts = browser.execute_script(
            "return document.querySelector('#engines tbody tr[data-engine=\"' + arguments[0] + '\"] td:nth-child(3)')"
            ".textContent", engine_state(browser)[1])
        assert restarts == "1"
    finally:
        stop.set()
        for t in threads:
            t.join(10)

    origin = urlparse(base).netloc
    urls = []
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    assert any(u.endswith("/scheduler/stats/stream") for u in urls)
    assert any(u.endswith("/uPlot.iife.min.js") for u in urls)
    strangers = [u for u in urls if urlparse(u).netloc != origin and not u.startswith(("data:", "blob:"))]
    assert not strangers, strangers


def _no_session_load(base: str, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            with httpx.stream("POST", f"{base}/v1/completions", json={**LOAD, "max_tokens": 60}, timeout=60) as resp:
                for _ in resp.iter_lines():
                    pass
        except Exception:  # noqa: BLE001 - the server stops at the end of the test
            time.sleep(0.2)


def test_a_fresh_page_shows_the_last_minute_plain_labels_and_one_no_session_row(tmp_path, tiny_model_dir, browser):
    """Two engines serve requests without a session id; a page opened 8 s later draws
    those 8 s at once, on a one-minute axis, labels the queues plainly with the card's
    names beside them, and lists the session-less requests as one row."""
    group = ProcessGroup(tmp_path)
    port = free_port()
    group.spawn(["-m", "shared.cli", "serve", "--model", str(tiny_model_dir), "--port", str(port), "--device", "cpu",
                 "--torch-threads", "1", "--data-parallel-size", "2", "--log-level", "warning"], "serve")
    base = f"http://127.0.0.1:{port}"
    stop = threading.Event()
    threads = [threading.Thread(target=_no_session_load, args=(base, stop), daemon=True) for _ in range(4)]
    try:
        wait_healthy(base, 120)
        wait_for(lambda: httpx.get(f"{base}/health").json().get("num_engines_up") == 2, 60, 0.2, "both engines up")
        for t in threads:
            t.start()
        time.sleep(8)
        opened = time.time()
        browser.get(f"{base}/dashboard")
        wait_for(lambda: number(browser, "updates") >= 1, 30, 0.1, "the first stats event")
        oldest, span = browser.execute_script(
            "const p = charts.queues.plot; return [charts.queues.data[0][0], p.scales.x.max - p.scales.x.min]")
        assert oldest < opened - 5, (oldest, opened)  # the history event drew the seconds before the page
        assert abs(span - 60) < 1, span  # a minute from the first second, not years
        card = browser.execute_script("return document.getElementById('c-queues').parentElement.textContent")
        for label, name in (("waiting", "_pending"), ("prefilling", "_prefilling"), ("decoding", "_active")):
            assert label in card and name in card
        wait_for(lambda: browser.execute_script(
            "return [...document.querySelectorAll('#sessions tbody tr td:first-child')].map(td => td.textContent)")
            == ["(no session)"], 20, 0.2, "one (no session) row")
        assert "(none)" not in browser.execute_script("return document.body.textContent")
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        group.close()
