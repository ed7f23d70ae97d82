"""The playground page at `/`, in a real headless browser (Debian's chromium + chromium-driver, driven by selenium):
load it, send a prompt, see the reply stream in with accepted drafts and target tokens marked, and live τ."""
from __future__ import annotations

import shutil

import pytest

from serving import running_server
from specrt.runtime.engine import Engine, Request
from specrt.runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver") or shutil.which("chromium-driver")
if not (CHROMIUM and DRIVER):
    pytest.skip("needs a browser: apt-get install chromium chromium-driver (.ci/run installs them)",
                allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install 'specrt[test]')")

QUESTION = "Write a Python function that checks whether a number is prime."
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def test_playground_streams_a_marked_reply(served_art, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    with Engine(served_art) as engine:
        tok = engine.tokenizer
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]), add_special_tokens=False)
        (expected,), _ = engine.generate([Request(ids, SamplingParams(max_new_tokens=MAX_TOKENS))])
    with running_server(served_art, "--method", "dspark", "--scheduler", "fixed", "--threads", "1") as url:
        browser.get(url + "/")
        wait = WebDriverWait(browser, 90)
        wait.until(ec.text_to_be_present_in_element((By.ID, "model"), "dspark"))
        box = browser.find_element(By.ID, "max")
        box.clear()
        box.send_keys(str(MAX_TOKENS))
        browser.find_element(By.ID, "prompt").send_keys(QUESTION)
        browser.find_element(By.ID, "send").click()
        reply = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, ".assistant[data-done='1']")))
        tokens = reply.find_elements(By.CSS_SELECTOR, ".tok")
        drafted = reply.find_elements(By.CSS_SELECTOR, ".tok.drafted")
        assert len(tokens) == len(expected.output_ids)
        assert 0 < len(drafted) < len(tokens)  # both kinds shown
        shown = browser.execute_script("return arguments[0].textContent", reply)
        assert shown.strip() == expected.text.strip()  # greedy: the same answer as a direct run
        tau = float(browser.find_element(By.ID, "tau").text)
        assert tau == pytest.approx(len(tokens) / (len(tokens) - len(drafted)), abs=0.01)
        assert float(browser.find_element(By.ID, "tps").text) > 0
        assert int(browser.find_element(By.ID, "ntok").text) == len(tokens)
