"""The README's screenshot of the web chat: `specsot serve` with the default model on a free port,
Debian's chromium (through selenium, as tests/test_server.py drives it) asking one question, the
page saved once the answer is complete.

    python docs/screenshot.py [--question "..."] [--out docs/webchat.png]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--question", default="How can I make my small apartment feel bigger?")
    p.add_argument("--out", default="docs/webchat.png")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-c", "from specsot_mq.cli.app import main; main()", "serve", "--port", str(port)])
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,860"):
        options.add_argument(arg)
    driver = None
    try:
        deadline = time.monotonic() + 300
        while not _healthy(base):
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the server did not become ready")
            time.sleep(1)
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        wait = WebDriverWait(driver, 300)
        driver.get(base + "/")
        wait.until(lambda d: d.find_element(By.ID, "model").text.startswith("model: "))
        driver.find_element(By.ID, "input").send_keys(args.question, Keys.ENTER)
        wait.until(lambda d: "mode" in d.find_element(By.CSS_SELECTOR, ".assistant .stats").text)
        driver.save_screenshot(args.out)
        print(f"{args.out}: {driver.find_element(By.CSS_SELECTOR, '.assistant .stats').text}")
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(30)


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    main()
