"""The dashboard (issue 10) in Debian's headless chromium, driven by Selenium
through Debian's chromedriver: the page loads, logs in with Basic
credentials, shows a queue made here with its depth, and its purge button
empties the queue. Screenshots are kept as test artifacts in
$WEIR_TEST_ARTIFACTS (default: <repo>/target/test-artifacts/):
dashboard-before-purge.png, dashboard-after-purge.png, and
dashboard-failure.png when a step fails."""
from __future__ import annotations

import base64
import json
import os
import shutil
import urllib.request
import uuid
from pathlib import Path

import pika
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

from weirproc import REPO_ROOT, Weir

N = 25
WAIT = 20  # seconds a DOM condition may take (the page polls every 2 s)
ARTIFACTS = Path(os.environ.get("WEIR_TEST_ARTIFACTS") or REPO_ROOT / "target" / "test-artifacts")

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("WEIR_TEST_URL")), reason="the dashboard is Weir's own: needs a weir started here")


@pytest.fixture
def weir(tmp_path):
    (tmp_path / "data").mkdir()
    w = Weir(tmp_path / "data", tmp_path / "weir.log").start()
    try:
        yield w
    finally:
        if w.proc.poll() is None:
            try:
                w.stop()
            except RuntimeError:
                pass


@pytest.fixture
def browser():
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    driver_bin = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    if not (os.path.exists(chromium) and os.path.exists(driver_bin)):
        pytest.fail("chromium and chromium-driver are needed: run scripts/install-deps.sh")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1100", "--disable-extensions", "--no-first-run"):
        opts.add_argument(arg)
    # An explicit driver path: Selenium Manager never downloads one.
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=driver_bin))
    try:
        yield driver
    finally:
        driver.quit()


def screenshot(driver, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    driver.save_screenshot(str(path))
    return path


def api(weir, method: str, path: str, body=None):
    """One management API call as guest; the JSON answer (None if empty)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{weir.http_port}{path}", data=data, method=method)
    req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read()
        return json.loads(text) if text else None


def login(browser, weir, user: str, password: str):
    browser.get(f"http://127.0.0.1:{weir.http_port}/")
    form = WebDriverWait(browser, WAIT).until(EC.visibility_of_element_located((By.ID, "login")))
    form.find_element(By.NAME, "user").send_keys(user)
    form.find_element(By.NAME, "password").send_keys(password)
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()


def row(name: str) -> str:
    """The CSS selector of queue `name`'s row (vhost /)."""
    return f'#queues tr[data-vhost="/"][data-name="{name}"]'


def row_depth(driver, name: str):
    """The depth the queue's row shows, or None while the row is absent."""
    cells = driver.find_elements(By.CSS_SELECTOR, f"{row(name)} td.depth")
    return cells[0].get_attribute("data-depth") if cells else None


def test_dashboard_shows_depth_and_purges(weir, browser):
    name = f"dash.{uuid.uuid4().hex[:8]}"
    conn = pika.BlockingConnection(pika.URLParameters(weir.url))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(name, durable=True)
        for i in range(N):
            ch.basic_publish("", name, f"m{i}".encode(), mandatory=True)

        wait = WebDriverWait(browser, WAIT, ignored_exceptions=(StaleElementReferenceException,))
        try:
            browser.get(f"http://127.0.0.1:{weir.http_port}/")
            assert "Weir" in browser.title
            # Not logged in yet: the login form, and no data.
            form = wait.until(EC.visibility_of_element_located((By.ID, "login")))
            assert not browser.find_element(By.ID, "app").is_displayed()
            form.find_element(By.NAME, "user").send_keys("guest")
            form.find_element(By.NAME, "password").send_keys("guest")
            form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()

            wait.until(EC.visibility_of_element_located((By.ID, "app")))
            wait.until(lambda d: row_depth(d, name) == str(N))
            # The overview counts the queue's messages too.
            wait.until(lambda d: d.find_element(By.CSS_SELECTOR, '[data-total="messages"] b').text == str(N))
            # A click on the row opens its charts: rates, depth, latency,
            # oldest age, attempts (the overview has its latency chart too).
            browser.find_element(By.CSS_SELECTOR, f"{row(name)} td.name").click()
            wait.until(EC.visibility_of_element_located((By.ID, "queue-detail")))
            assert name in browser.find_element(By.ID, "detail-title").text
            for chart in ("chart-latency", "detail-rates", "detail-depth", "detail-latency", "detail-age", "detail-attempts"):
                assert browser.find_element(By.ID, chart).is_displayed(), chart
            screenshot(browser, "dashboard-before-purge.png")

            # Purge (administrators see the button), confirming the dialog.
            browser.find_element(By.CSS_SELECTOR, f'{row(name)} button[data-action="purge"]').click()
            wait.until(EC.alert_is_present())
            alert = browser.switch_to.alert
            assert name in alert.text
            alert.accept()
            wait.until(lambda d: row_depth(d, name) == "0")
            shot = screenshot(browser, "dashboard-after-purge.png")
            assert shot.stat().st_size > 0
        except Exception:
            screenshot(browser, "dashboard-failure.png")
            raise

        # The broker agrees: the queue is empty, seen over AMQP and over the API.
        assert ch.queue_declare(name, durable=True, passive=True).method.message_count == 0
        assert api(weir, "GET", f"/api/queues/%2F/{name}")["messages"] == 0
        ch.queue_delete(name)
    finally:
        if conn.is_open:
            conn.close()


def test_dashboard_rejects_wrong_password(weir, browser):
    browser.get(f"http://127.0.0.1:{weir.http_port}/")
    wait = WebDriverWait(browser, WAIT)
    form = wait.until(EC.visibility_of_element_located((By.ID, "login")))
    form.find_element(By.NAME, "user").send_keys("guest")
    form.find_element(By.NAME, "password").send_keys("not-the-password")
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait.until(lambda d: d.find_element(By.ID, "login-error").text != "")
    assert not browser.find_element(By.ID, "app").is_displayed()
    # Nothing is kept for a failed login.
    assert browser.execute_script("return sessionStorage.getItem('weir.auth')") is None


def test_dashboard_hides_actions_from_non_administrators(weir, browser):
    """A monitoring user sees the queue and its depth, but no purge,
    requeue or delete buttons."""
    name = f"dash.{uuid.uuid4().hex[:8]}"
    api(weir, "PUT", f"/api/queues/%2F/{name}", {"durable": True})
    api(weir, "PUT", "/api/users/watcher", {"password": "watch-pw", "tags": "monitoring"})
    api(weir, "PUT", "/api/permissions/%2F/watcher", {"configure": "", "write": "", "read": ".*"})
    login(browser, weir, "watcher", "watch-pw")
    wait = WebDriverWait(browser, WAIT, ignored_exceptions=(StaleElementReferenceException,))
    wait.until(lambda d: row_depth(d, name) == "0")
    assert "monitoring" in browser.find_element(By.ID, "who").text
    buttons = browser.find_elements(By.CSS_SELECTOR, f'{row(name)} button[data-action]')
    assert buttons and not any(b.is_displayed() for b in buttons)
    # A guest's view of the same row has them.
    browser.execute_script("sessionStorage.clear()")
    login(browser, weir, "guest", "guest")
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, f'{row(name)} button[data-action="purge"]').is_displayed())
