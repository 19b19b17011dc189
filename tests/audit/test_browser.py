"""The sheet in a real browser: headless Chromium from file://, keyboard labelling, reload resume, real download.

Slow-ish (a browser start, ~5-15 s) but runs in CI; skipped only where Chromium or its driver is absent
(``apt-get install -y chromium chromium-driver``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

import pytest

from mechprobe.audit import load_run_table, load_sample
from mechprobe.cli.audit import add_args, run
from mechprobe.io import read_json
from mechprobe.taxonomy import LABELS

from .run_fixture import build_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (CHROMIUM and DRIVER),
                       reason="headless browser test needs Chromium and its driver: apt-get install -y chromium "
                              "chromium-driver"),
]


def _ns(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(list(argv))


@pytest.fixture()
def browser(tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium (the dev extra)")
    from selenium.webdriver.chrome.service import Service

    downloads = tmp_path / "downloads"
    downloads.mkdir()
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1300,1000", f"--user-data-dir={tmp_path / 'profile'}"):
        opts.add_argument(arg)
    opts.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                           "download.prompt_for_download": False})
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    driver.downloads = downloads
    yield driver
    driver.quit()


def _wait(cond, timeout=20.0):
    end = time.time() + timeout
    while time.time() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError("timed out waiting in the browser test")


def test_label_reload_export_import(browser, tmp_path, capsys):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    run_dir = tmp_path / "run"
    truth = build_run(run_dir, n_steer_items=6, n_probe_items=2)
    assert run(_ns(str(run_dir), "--n", "8", "--by", "condition")) == 0
    capsys.readouterr()
    sample = load_sample(run_dir)
    keys = sample.keys()
    want = {k: truth["E"].get(rid) or truth["C"][rid] for k, rid in keys.items()}
    table = load_run_table(run_dir)

    browser.get((run_dir / "audit" / "sheet.html").as_uri())
    body = browser.find_element(By.TAG_NAME, "body")
    assert browser.find_element(By.ID, "progress").text == "0 / 8 labelled"
    name = browser.find_element(By.ID, "labeller-name")
    name.send_keys("alice")
    name.send_keys("1")  # typing in a field must not label
    name.send_keys(Keys.BACKSPACE, Keys.ESCAPE)
    assert browser.find_element(By.ID, "progress").text == "0 / 8 labelled"

    seen, shown = [], []
    for i in range(8):
        key = browser.execute_script("return document.getElementById('position').textContent").split("(")[1][:-1]
        seen.append(key)
        turn = browser.find_element(By.ID, "turn").text
        assert turn.strip() == table.get(keys[key]).turn.strip()  # special tokens shown literally
        shown.append(turn)
        if "<|im_" in turn:  # highlighted as tokens, still plain text
            assert browser.find_elements(By.CSS_SELECTOR, "#turn span.tok")
        body.send_keys(str(LABELS.index(want[key]) + 1))
        if i == 0:
            body.send_keys("b")
        body.send_keys(Keys.ARROW_RIGHT if i % 2 else "n")
    assert sorted(seen) == sorted(keys)
    assert browser.find_element(By.ID, "progress").text == "8 / 8 labelled"
    assert any("<|im_" in t for t in shown)

    browser.refresh()  # localStorage keyed by the sample id: everything is still there
    assert _wait(lambda: browser.find_element(By.ID, "progress").text) == "8 / 8 labelled"
    assert browser.find_element(By.ID, "labeller-name").get_attribute("value") == "alice"
    body = browser.find_element(By.TAG_NAME, "body")
    body.send_keys("p")
    for _ in range(8):
        body.send_keys("p")
    assert browser.find_element(By.ID, "borderline").is_selected()  # row 1 kept its borderline flag
    browser.find_element(By.ID, "note").send_keys("the answer's step")
    body.send_keys("e")
    got = _wait(lambda: [p for p in browser.downloads.glob("*.json")])
    exported = got[0]
    assert exported.name == f"labels_alice_{sample.sample_id}.json"
    data = json.loads(_wait(lambda: exported.read_text() or None))
    assert data["labeller"] == {"name": "alice", "kind": "person"} and data["sample_id"] == sample.sample_id
    assert {r["row"]: r["label"] for r in data["rows"]} == want
    browser.save_screenshot(str(tmp_path / "sheet.png"))

    assert run(_ns(str(run_dir), "--labels", str(exported), "--n-boot", "20")) == 0
    out = capsys.readouterr().out
    assert "alice (person, 8 labelled, 1 borderline)" in out
    stored = read_json(run_dir / "audit" / "labels" / "alice.json")
    assert sum(r["note"] == "the answer's step" for r in stored["rows"]) == 1
    rep = read_json(run_dir / "audit" / "report.json")
    assert sum(r["n_audited"] for r in rep["rates"].values()) == 8
    assert {k["stratum"] for k in rep["judge_vs_labeller"]} == {*rep["rates"], "all"}
    assert all(k["binary"]["n"] == 2 for k in rep["judge_vs_labeller"] if k["stratum"] != "all")
