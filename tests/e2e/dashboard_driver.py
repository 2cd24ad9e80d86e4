"""Drives `corral dashboard` in a real browser (Debian's chromium, through chromedriver and
selenium), run where the dashboard listens (the appliance namespace):

  python -m tests.e2e.dashboard_driver URL TARGET SESSION SHOTS_DIR

Opens the page; waits for the approval that would allow TARGET; checks that what an agent
wrote is shown as text (no element made of it); clicks its `once` button and waits for it
to go; then visits each page and saves a screenshot of it in SHOTS_DIR. Prints one JSON
object: what it saw. Exits 1 with the reason when a step fails.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def browser(profile: str) -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic",
                 f"--user-data-dir={profile}", "--window-size=1400,900"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def until(what: str, check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout:.0f}s")


def approval_row(driver, target: str):
    try:
        for row in driver.find_elements(By.CSS_SELECTOR, "#approvals-rows tr"):
            if target in row.text:
                return row
    except StaleElementReferenceException:  # the table changed while it was read: again
        pass
    return None


def click_once(driver, target: str) -> bool:
    row = approval_row(driver, target)
    try:
        row.find_element(By.CSS_SELECTOR, "button.once").click()
        return True
    except (StaleElementReferenceException, AttributeError):
        return False


def main(url: str, target: str, session: str, shots: Path) -> dict:
    shots.mkdir(parents=True, exist_ok=True)
    seen: dict = {}
    with tempfile.TemporaryDirectory(prefix="corral-chromium-") as profile:
        driver = browser(profile)
        try:
            driver.get(url)
            until(f"approval for {target}", lambda: approval_row(driver, target))
            until("the stream to go live", lambda: driver.find_element(By.ID, "link").text
                  == "live")
            untrusted = [td.text for td in driver.find_elements(
                By.CSS_SELECTOR, "#approvals-rows td.untrusted")]
            seen["reasons"] = untrusted
            seen["elements_in_reasons"] = len(driver.find_elements(
                By.CSS_SELECTOR, "#approvals-rows td.untrusted *"))
            driver.save_screenshot(str(shots / "approvals.png"))
            # a button takes a click only once it has been on the page a moment (a row
            # that moves under the pointer must not take one): click until it is decided
            until(f"the approval for {target} to close, clicking once", lambda: (
                click_once(driver, target), time.sleep(0.8),
                approval_row(driver, target) is None)[-1], timeout=90)
            seen["approved"] = target

            driver.find_element(By.CSS_SELECTOR, "nav button[data-page=sessions]").click()
            until(f"session {session} listed", lambda: session in driver.find_element(
                By.ID, "sessions-rows").text)
            driver.save_screenshot(str(shots / "sessions.png"))

            driver.find_element(By.CSS_SELECTOR, "nav button[data-page=decisions]").click()
            Select(driver.find_element(By.ID, "decisions-session")).select_by_value(session)
            rows = until("decisions of the session", lambda: driver.find_elements(
                By.CSS_SELECTOR, "#decisions-rows tr"))
            seen["decisions"] = len(rows)
            seen["approved_event"] = any("approved" in r.text for r in rows)
            driver.save_screenshot(str(shots / "decisions.png"))

            driver.find_element(By.CSS_SELECTOR, "nav button[data-page=rules]").click()
            Select(driver.find_element(By.ID, "rules-session")).select_by_value(session)
            until("the session's rules", lambda: driver.find_elements(
                By.CSS_SELECTOR, "#rules-rows tr"))
            driver.save_screenshot(str(shots / "rules.png"))

            driver.find_element(By.CSS_SELECTOR, "nav button[data-page=health]").click()
            until("the appliance's health", lambda: driver.find_elements(
                By.CSS_SELECTOR, "#health-list dt"))
            driver.find_element(By.ID, "verify").click()
            seen["audit"] = until("the audit verdict", lambda: (
                text := driver.find_element(By.ID, "verify-result").text).startswith(
                    ("intact", "broken")) and text)
            driver.save_screenshot(str(shots / "health.png"))
            seen["trouble"] = driver.find_element(By.ID, "trouble").text
        finally:
            driver.quit()
    return seen


if __name__ == "__main__":
    url, target, session, shots = sys.argv[1:5]
    try:
        print(json.dumps(main(url, target, session, Path(shots))))
    except Exception as exc:  # the test prints it: which step, and what the page showed
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        sys.exit(1)
