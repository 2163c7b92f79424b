"""The dashboard as a person sees it: a real headless Chromium (Debian's, through its
chromedriver, driven by selenium) on a controller walking a plan.

`make test` installs chromium and chromium-driver with apt-get (`.ci/apt-install`); only
where they truly cannot be had are these tests skipped, with the reason. Screenshots go to
$SPINE_TEST_ARTIFACTS (default: test-artifacts/ at the repository root).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from migration.gates import WindowStats
from migration.plan import load_plan
from migration.recording import RecordingTarget
from migration.server import ControllerProcess
from migration.testing import ADMIN_TOKEN, HEALTHY

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is a dev dependency: make install")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("SPINE_TEST_ARTIFACTS", ROOT / "test-artifacts"))
# As root, Chromium needs --no-sandbox; the rest keep it off the network and quick to start.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1400,1300")
PLAN = textwrap.dedent("""\
    name: browser
    window_s: 0.2
    min_window_requests: 5
    stages:
      - {name: canary-logs, spine_weight: 10, placements: {logs: local}, hold_s: 600,
         gates: [{type: error_rate, max_delta: 0.01}]}
      - {name: half-cache, spine_weight: 50, placements: {cache: local}, hold_s: 600, failure_limit: 1,
         gates: [{type: error_rate, max_delta: 0.01}]}
      - {name: everything, spine_weight: 100, placements: {auth: local}, hold_s: 1}
    """)
RED = (198, 40, 40)  # dashboard.css's --bad (#c62828): the banner of a rolled-back rollout


def binaries() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("Debian's chromium and chromium-driver are not installed and `make test` could not "
                    "install them (.ci/apt-install: apt-get missing or refused)")
    return chromium, driver


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium, driver = binaries()
    profile = tempfile.mkdtemp(prefix="spine-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    session = webdriver.Chrome(options=options, service=Service(driver))
    try:
        yield session
    finally:
        session.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def controller(tmp_path, request) -> Iterator[tuple[ControllerProcess, RecordingTarget]]:
    sockets = tempfile.mkdtemp(prefix="browse", dir="/tmp")
    target = RecordingTarget(layered=HEALTHY, spine=HEALTHY)
    closed = request.node.get_closest_marker("viewing_needs_the_token") is not None
    process = ControllerProcess(str(tmp_path / "m.db"), f"unix:{sockets}/c.sock", ADMIN_TOKEN, target,
                                tick_s=0.02, dashboard_listen="127.0.0.1:0", view_without_token=not closed)
    process.start()
    process.controller.start(load_plan(PLAN), "test")
    try:
        yield process, target
    finally:
        process.stop(grace=0.2)
        shutil.rmtree(sockets, ignore_errors=True)


def wait(browser: Any, condition: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    return WebDriverWait(browser, timeout, poll_frequency=0.1).until(lambda _: condition(), message=what)


def read(browser: Any, selector: str, what: str = "textContent") -> str:
    """A property of the element `selector` finds now, read in one step (the page redraws
    its panels on every event, so an element found a moment ago may be gone)."""
    return browser.execute_script(f"const e = document.querySelector({selector!r}); return e ? e.{what} : ''")


def current_stage(browser: Any) -> str:
    return read(browser, "#timeline li.current", "dataset.stage")


def open_page(browser: Any, process: ControllerProcess) -> None:
    browser.get(process.dashboard_url)
    wait(browser, lambda: current_stage(browser) == "canary-logs", "the page shows the first stage as current")
    browser.execute_script("window.spineLoaded = 'once'")  # gone if the page reloads


def rgb(css: str) -> tuple[int, ...]:
    """(r, g, b) of a computed `rgb(...)` or `rgba(...)` colour."""
    return tuple(int(part) for part in re.findall(r"\d+", css)[:3])


def screenshot(browser: Any, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    assert browser.save_screenshot(str(path))
    return path


def test_the_stage_advances_on_the_page_without_a_reload(browser, controller):
    process, _ = controller
    open_page(browser, process)
    browser.find_element(By.ID, "token").send_keys(ADMIN_TOKEN)
    browser.find_element(By.ID, "actor").send_keys("alice")
    browser.find_element(By.CSS_SELECTOR, "button[data-command=advance]").click()
    wait(browser, lambda: current_stage(browser) == "half-cache", "the page shows the second stage as current")
    assert browser.execute_script("return window.spineLoaded") == "once"
    assert "spine 50%" in read(browser, "#weights-text")
    assert "done by alice@dashboard" in browser.find_element(By.ID, "command-result").text
    row = process.controller.store.audit()[-1]
    assert (row.action, row.actor, row.stage) == ("advance", "alice@dashboard(127.0.0.1)", "half-cache")
    # A transition made elsewhere (the CLI, the controller itself) reaches the open page too.
    process.controller.advance("everything", "bob@cli")
    wait(browser, lambda: browser.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "promoted",
         "the page shows the rollout promoted")
    assert browser.execute_script("return window.spineLoaded") == "once"
    assert screenshot(browser, "dashboard-promoted.png").stat().st_size > 0


def test_the_judge_table_shows_the_score_and_each_metrics_verdict(browser, tmp_path):
    import numpy as np

    rng = np.random.default_rng(5)

    def side(median_ms: float) -> WindowStats:
        samples = tuple(float(v) for v in rng.lognormal(np.log(median_ms), 0.3, 300))
        return WindowStats(requests=300, errors=0, p99_ms=max(samples), latency_samples_ms=samples)

    sockets = tempfile.mkdtemp(prefix="browse", dir="/tmp")
    target = RecordingTarget(layered=side(20.0), spine=side(26.0))  # slower: latency High, score 80, marginal
    process = ControllerProcess(str(tmp_path / "m.db"), f"unix:{sockets}/c.sock", ADMIN_TOKEN, target,
                                tick_s=0.02, dashboard_listen="127.0.0.1:0", view_without_token=True)
    process.start()
    judged = PLAN.replace("stages:\n", "judge:\n  groups:\n"
                          "    - {name: latency, weight: 20, metrics: [{name: latency, kind: latency}]}\n"
                          "    - {name: errors, weight: 80, metrics: [{name: errors, kind: error_rate}]}\n"
                          "stages:\n")
    try:
        process.controller.start(load_plan(judged), "test")
        open_page(browser, process)
        wait(browser, lambda: read(browser, "#judge tr[data-metric=latency]") != "", "the judge's table is drawn")
        assert read(browser, "#judge-score").startswith(
            "marginal: score 80.0 < pass 90, >= marginal 75, holding the stage for another window (at 98% confidence)")
        latency = read(browser, "#judge tr[data-metric=latency]")
        assert latency.startswith("latencyhigh") and "98% CI [" in latency
        assert read(browser, "#judge tr[data-metric=errors]").startswith("errorspass")
        assert screenshot(browser, "dashboard-judge.png").stat().st_size > 0
    finally:
        process.stop(grace=0.2)
        shutil.rmtree(sockets, ignore_errors=True)


def test_a_button_without_the_token_is_refused_on_the_page(browser, controller):
    process, _ = controller
    open_page(browser, process)
    browser.execute_script("sessionStorage.clear(); document.getElementById('token').value = ''")
    browser.find_element(By.CSS_SELECTOR, "button[data-command=pause]").click()
    result = browser.find_element(By.ID, "command-result")
    wait(browser, lambda: "refused" in (result.get_attribute("class") or ""), "the page says the command was refused")
    assert "refused (401)" in result.text and "admin token" in result.text
    assert process.controller.status.state == "progressing"
    assert [row.action for row in process.controller.store.audit()] == ["start"]


@pytest.mark.viewing_needs_the_token
def test_where_viewing_needs_the_token_the_page_asks_for_it_then_shows_the_rollout(browser, controller):
    process, _ = controller
    browser.get(process.dashboard_url)
    browser.execute_script("sessionStorage.clear()")
    wait(browser, lambda: "needs the admin token" in read(browser, "#freshness"), "the page asks for the token")
    assert current_stage(browser) == ""  # nothing of the rollout without it
    browser.find_element(By.ID, "token").send_keys(ADMIN_TOKEN)
    wait(browser, lambda: current_stage(browser) == "canary-logs", "the page shows the rollout once given the token")


def test_a_rollback_turns_the_page_red(browser, controller):
    process, target = controller
    open_page(browser, process)
    process.controller.advance("half-cache", "test")
    wait(browser, lambda: current_stage(browser) == "half-cache", "the page shows the second stage")
    target.spine = WindowStats(requests=100, errors=40, p99_ms=10.0)  # the spine fails: the gate rolls back
    body = browser.find_element(By.TAG_NAME, "body")
    wait(browser, lambda: body.get_attribute("data-state") == "rolled_back", "the page shows the rollback")
    banner = browser.find_element(By.ID, "banner")
    wait(browser, lambda: rgb(banner.value_of_css_property("background-color")) == RED, "the banner turns red")
    assert browser.find_element(By.ID, "state").text == "ROLLED BACK"
    chart = "#gates .chart[data-gate=error_rate] h3"
    assert "(fail)" in read(browser, chart) and read(browser, chart, "className") == "verdict-fail"
    assert browser.execute_script("return window.spineLoaded") == "once"
    assert screenshot(browser, "dashboard-rolled-back.png").stat().st_size > 0


@pytest.mark.slow
def test_the_dashboard_during_the_demo(browser):
    """`make run`'s demo (`spine demo`): the printed URL's page follows the stages live and
    turns red when the failing spine's run is rolled back (`pytest -m slow`: the demo starts
    ten processes and takes a minute)."""
    demo = subprocess.Popen([sys.executable, "-m", "spine", "demo"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert demo.stdout is not None
        url = ""
        for line in demo.stdout:
            found = re.search(r"dashboard: (http://127\.0\.0\.1:\d+/)", line)
            if found:
                url = found.group(1)
                break
        assert url, "the demo printed no dashboard URL"
        threading.Thread(target=demo.stdout.read, daemon=True).start()  # keep its pipe drained
        browser.get(url)
        wait(browser, lambda: current_stage(browser) != "", "the page shows a current stage", timeout=60)
        first = current_stage(browser)
        browser.execute_script("window.spineLoaded = 'once'")
        wait(browser, lambda: current_stage(browser) not in ("", first), "the page shows the next stage", timeout=60)
        body = browser.find_element(By.TAG_NAME, "body")
        wait(browser, lambda: body.get_attribute("data-state") == "rolled_back", "the page shows a rollback",
             timeout=120)
        assert rgb(browser.find_element(By.ID, "banner").value_of_css_property("background-color")) == RED
        assert browser.execute_script("return window.spineLoaded") == "once"
        screenshot(browser, "dashboard-demo-rolled-back.png")
    finally:
        demo.send_signal(signal.SIGTERM)
        try:
            demo.wait(timeout=60)
        except subprocess.TimeoutExpired:
            demo.kill()
            demo.wait()
