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
from mechprobe.audit.identify import load_pairs
from mechprobe.cli.audit import add_args, run
from mechprobe.io import read_json
from mechprobe.taxonomy import DEFINITIONS, GENUINE, LABELS

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


def _pos(browser) -> int:
    return int(browser.find_element("tag name", "body").get_attribute("data-pos"))


def _key(browser) -> str:
    return browser.execute_script("return document.getElementById('position').textContent").split("(")[1][:-1]


def _cells(browser) -> list[str]:
    return browser.execute_script(
        "return Array.from(document.querySelectorAll('#overview button')).map(b => b.dataset.state)")


def _set_stop_reasons(run_dir, cut: set[str]) -> None:
    """Only the items in ``cut`` keep ``stop_reason == "max_tokens"`` (the fixture cuts every answer)."""
    p = run_dir / "assistant.jsonl"
    rows = [json.loads(line) for line in p.read_text().splitlines()]
    for r in rows:
        r["stop_reason"] = "max_tokens" if r["item_id"] in cut else "end_of_turn"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_label_reload_export_import(browser, tmp_path, capsys):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    run_dir = tmp_path / "run"
    truth = build_run(run_dir, n_steer_items=6, n_probe_items=2)
    items = sorted({json.loads(line)["item_id"] for line in (run_dir / "assistant.jsonl").read_text().splitlines()})
    _set_stop_reasons(run_dir, set(items[::2]))
    assert run(_ns(str(run_dir), "--n", "8", "--by", "condition")) == 0
    out = capsys.readouterr().out
    assert "open " + str(run_dir / "audit" / "sheet.html") in out and f"mechprobe audit {run_dir} --labels" in out
    sample = load_sample(run_dir)
    keys = sample.keys()
    want = {k: truth["E"].get(rid) or truth["C"][rid] for k, rid in keys.items()}
    table = load_run_table(run_dir)

    browser.get((run_dir / "audit" / "sheet.html").as_uri())
    body = browser.find_element(By.TAG_NAME, "body")
    assert browser.find_element(By.ID, "progress").text == "0 / 8 labelled"
    # the codebook is beside the row, not folded away below it; every definition is shown next to its button
    book, turn_box = browser.find_element(By.ID, "codebook-pane"), browser.find_element(By.ID, "turn-box")
    assert book.is_displayed() and book.rect["x"] > turn_box.rect["x"] + turn_box.rect["width"]
    assert book.rect["y"] < turn_box.rect["y"] + turn_box.rect["height"]
    assert "decision order" in browser.find_element(By.ID, "codebook").text.lower()
    defs = [d.text for d in browser.find_elements(By.CSS_SELECTOR, "#labels button.choice .def")]
    assert defs == [DEFINITIONS[lab] for lab in LABELS] and all(
        d.is_displayed() for d in browser.find_elements(By.CSS_SELECTOR, "#labels button.choice .def"))
    assert _cells(browser) == ["open"] * 8

    # export without a name: one accurate message, gone as soon as the name is typed
    body.send_keys("e")
    msg = browser.find_element(By.ID, "status").text
    assert "Labeller name" in msg and "export again" in msg
    name = browser.find_element(By.ID, "labeller-name")
    name.send_keys("alice")
    assert browser.find_element(By.ID, "status").text == ""
    name.send_keys("1")  # typing in a field must not label
    name.send_keys(Keys.BACKSPACE, Keys.ESCAPE)
    assert browser.find_element(By.ID, "progress").text == "0 / 8 labelled"

    # the answer scrolls with j/k and opens at full length with f; the badge marks answers cut at the cap
    longest = browser.execute_script("var r = JSON.parse(document.getElementById('sheet-data').textContent).rows;"
                                     "var l = r.map(x => x.answer.length); return l.indexOf(Math.max(...l));")
    browser.find_elements(By.CSS_SELECTOR, "#overview button")[longest].click()
    browser.set_window_size(1300, 600)  # so that the longest answer overflows its box
    answer = browser.find_element(By.ID, "answer")
    assert answer.text.strip() == table.get(keys[_key(browser)]).answer.strip()
    height = "return [arguments[0].scrollHeight, arguments[0].clientHeight, arguments[0].scrollTop]"
    full, box, top = browser.execute_script(height, answer)
    assert full > box and top == 0
    body.send_keys("j")
    assert browser.execute_script(height, answer)[2] > 0
    body.send_keys("k")
    assert browser.execute_script(height, answer)[2] == 0
    body.send_keys("f")
    assert "full" in answer.get_attribute("class")
    full, box, _ = browser.execute_script(height, answer)
    assert box >= full - 1  # the whole answer, no inner scroll
    body.send_keys("f")
    browser.set_window_size(1300, 1000)
    badges = set()
    for _ in range(8):
        cut = table.get(keys[_key(browser)]).answer_stop_reason == "max_tokens"
        assert browser.find_element(By.ID, "cut-badge").is_displayed() == cut
        badges.add(cut)
        body.send_keys("n")
    assert badges == {True, False}
    body.send_keys(Keys.HOME)
    for _ in range(8):
        body.send_keys("p")
    assert _pos(browser) == 0

    # label with keys: each label moves on to the next unlabelled row; b goes before the label
    seen, shown = [], []
    for i in range(6):
        key = _key(browser)
        assert _pos(browser) == i
        seen.append(key)
        turn = browser.find_element(By.ID, "turn").text
        assert turn.strip() == table.get(keys[key]).turn.strip()  # special tokens shown literally
        shown.append(turn)
        if "<|im_" in turn:  # highlighted as tokens, still plain text
            assert browser.find_elements(By.CSS_SELECTOR, "#turn span.tok")
        if i == 0:
            body.send_keys("b")
        body.send_keys(str(LABELS.index(want[key]) + 1))
        if want[key] == GENUINE:
            assert _pos(browser) == i  # waits for the strict choice
            body.send_keys("y")
    assert _pos(browser) == 6
    assert browser.find_element(By.ID, "progress").text == "6 / 8 labelled"
    assert _cells(browser) == ["done"] * 6 + ["open"] * 2
    assert "bl" in browser.find_elements(By.CSS_SELECTOR, "#overview button")[0].get_attribute("class")
    assert browser.find_element(By.ID, "overview-summary").text == "2 unlabelled, 1 borderline, 0 genuine_followup without strict"

    # clear a label (key 0), then the overview jumps back to it
    browser.find_elements(By.CSS_SELECTOR, "#overview button")[2].click()
    assert _pos(browser) == 2
    body.send_keys("0")
    assert browser.find_element(By.ID, "progress").text == "5 / 8 labelled"
    assert _cells(browser)[2] == "open" and _pos(browser) == 2
    assert not browser.find_elements(By.CSS_SELECTOR, "#labels button.choice.on")

    # export with rows unlabelled: a warning that can be declined, and a warning when it is accepted
    body.send_keys("e")
    alert = _wait(lambda: _alert(browser))
    assert "3 of 8 rows unlabelled" in alert.text
    alert.dismiss()
    assert "not exported" in browser.find_element(By.ID, "status").text
    assert not list(browser.downloads.glob("*.json"))
    body.send_keys("e")
    _wait(lambda: _alert(browser)).accept()
    partial = _wait(lambda: list(browser.downloads.glob("*.json")))[0]
    assert "3 of 8 rows unlabelled" in browser.find_element(By.ID, "status").text
    data = json.loads(_wait(lambda: partial.read_text() or None))
    assert sum(r["label"] is None for r in data["rows"]) == 3
    partial.unlink()

    # the remaining rows: jump to each open cell from the overview
    for i, state in enumerate(_cells(browser)):
        if state == "open":
            browser.find_elements(By.CSS_SELECTOR, "#overview button")[i].click()
            key = _key(browser)
            seen.append(key) if key not in seen else None
            body.send_keys(str(LABELS.index(want[key]) + 1))
            if want[key] == GENUINE:
                body.send_keys("y")
    assert sorted(seen) == sorted(keys)
    assert browser.find_element(By.ID, "progress").text == "8 / 8 labelled"
    assert "every row is labelled" in browser.find_element(By.ID, "status").text
    assert any("<|im_" in t for t in shown)

    browser.refresh()  # localStorage keyed by the sample id: everything is still there
    assert _wait(lambda: browser.find_element(By.ID, "progress").text) == "8 / 8 labelled"
    assert browser.find_element(By.ID, "labeller-name").get_attribute("value") == "alice"
    body = browser.find_element(By.TAG_NAME, "body")
    browser.find_elements(By.CSS_SELECTOR, "#overview button")[0].click()
    assert browser.find_element(By.ID, "borderline").is_selected()  # row 1 kept its borderline flag
    browser.find_element(By.ID, "note").send_keys("the answer's step")
    browser.find_element(By.ID, "note").send_keys(Keys.ESCAPE)
    body.send_keys("e")  # everything labelled: no question asked
    got = _wait(lambda: [p for p in browser.downloads.glob("*.json")])
    exported = got[0]
    assert exported.name == f"labels_alice_{sample.sample_id}.json"
    data = json.loads(_wait(lambda: exported.read_text() or None))
    assert data["labeller"] == {"name": "alice", "kind": "person"} and data["sample_id"] == sample.sample_id
    assert {r["row"]: r["label"] for r in data["rows"]} == want
    browser.save_screenshot(str(tmp_path / "sheet.png"))

    assert run(_ns(str(run_dir), "--labels", str(exported), "--n-boot", "20")) == 0
    out = capsys.readouterr().out
    n_genuine = sum(v == GENUINE for v in want.values())
    assert f"alice (person, 8 labelled, 1 borderline, strict given on {n_genuine})" in out
    stored = read_json(run_dir / "audit" / "labels" / "alice.json")
    assert sum(r["note"] == "the answer's step" for r in stored["rows"]) == 1
    rep = read_json(run_dir / "audit" / "report.json")
    assert sum(r["n_audited"] for r in rep["rates"].values()) == 8
    assert {k["stratum"] for k in rep["judge_vs_labeller"]} == {*rep["rates"], "all"}
    assert all(k["binary"]["n"] == 2 for k in rep["judge_vs_labeller"] if k["stratum"] != "all")


def _alert(browser):
    try:
        return browser.switch_to.alert
    except Exception:  # selenium's NoAlertPresentException: not open yet
        return None


def _strict_box(browser):
    from selenium.webdriver.common.by import By

    box = browser.find_element(By.ID, "strict-box")
    on = [b.get_attribute("data-strict") for b in box.find_elements(By.CSS_SELECTOR, "button.on")]
    return box.is_displayed(), on


def _entry(browser, key: str) -> dict:
    return browser.execute_script("return window.mechprobeAudit.state().labels[arguments[0]] || {}", key)


def test_strict_choice_on_genuine_rows(browser, tmp_path, capsys):
    """A genuine label waits for its strict choice; the choice is kept, exported, imported and read as strict."""
    from selenium.webdriver.common.by import By

    run_dir = tmp_path / "run"
    build_run(run_dir, n_steer_items=6, n_probe_items=2)
    assert run(_ns(str(run_dir), "--n", "8", "--by", "condition")) == 0
    capsys.readouterr()
    sample = load_sample(run_dir)
    genuine_key, new_query_key = str(LABELS.index(GENUINE) + 1), str(LABELS.index("new_query") + 1)

    browser.get((run_dir / "audit" / "sheet.html").as_uri())
    body = browser.find_element(By.TAG_NAME, "body")
    browser.find_element(By.ID, "labeller-name").send_keys("sam")
    assert _strict_box(browser) == (False, [])  # shown on genuine rows only
    summary = browser.find_element(By.ID, "overview-summary")

    # row 1: genuine waits (the overview marks it), then g chooses generic_followup and the next row opens
    keys = [_key(browser)]
    body.send_keys(genuine_key)
    assert _pos(browser) == 0 and _cells(browser)[0] == "strict" and _strict_box(browser) == (True, [])
    assert "strict reading" in browser.find_element(By.ID, "status").text
    assert summary.text == "7 unlabelled, 0 borderline, 1 genuine_followup without strict"
    assert browser.find_element(By.ID, "progress").text == "1 / 8 labelled"
    body.send_keys("g")
    assert _pos(browser) == 1 and _cells(browser)[0] == "done"
    # row 2: with the mouse, genuine then yes
    keys.append(_key(browser))
    browser.find_element(By.CSS_SELECTOR, f'#labels button.choice[data-label="{GENUINE}"]').click()
    assert _pos(browser) == 1
    browser.find_element(By.CSS_SELECTOR, '#strict-box button[data-strict="yes"]').click()
    assert _pos(browser) == 2
    # row 3: genuine + a, then relabelled new_query: the strict choice goes with the genuine label
    keys.append(_key(browser))
    body.send_keys(genuine_key)
    body.send_keys("a")
    assert _pos(browser) == 3 and _entry(browser, keys[2])["strict"] == "assistant_continuation"
    body.send_keys("p")
    assert _strict_box(browser) == (True, ["assistant_continuation"])
    body.send_keys(new_query_key)
    assert _entry(browser, keys[2])["label"] == "new_query" and not _entry(browser, keys[2])["strict"]
    assert _pos(browser) == 3
    body.send_keys("p")
    assert _strict_box(browser) == (False, [])
    body.send_keys("y")  # no strict choice on a row that is not genuine
    assert "genuine_followup rows only" in browser.find_element(By.ID, "status").text
    assert not _entry(browser, keys[2])["strict"] and _pos(browser) == 2
    body.send_keys("n")
    # row 4: genuine, left without a strict choice; the rest new_query, after which the genuine row opens again
    keys.append(_key(browser))
    body.send_keys(genuine_key)
    body.send_keys("n")
    for i in range(4, 8):
        assert _pos(browser) == i
        body.send_keys(new_query_key)
    assert _pos(browser) == 3 and _cells(browser)[3] == "strict"
    assert summary.text == "0 unlabelled, 0 borderline, 1 genuine_followup without strict"

    # export: warned about the genuine row without strict, like about unlabelled rows
    body.send_keys("e")
    alert = _wait(lambda: _alert(browser))
    assert "1 genuine_followup row(s) without a strict choice (first: row 4)" in alert.text
    assert "unlabelled" not in alert.text
    alert.dismiss()
    assert "not exported" in browser.find_element(By.ID, "status").text
    body.send_keys("d")
    assert "every row is labelled" in browser.find_element(By.ID, "status").text
    assert _cells(browser) == ["done"] * 8

    browser.refresh()  # kept in localStorage with the rest
    body = browser.find_element(By.TAG_NAME, "body")
    _wait(lambda: browser.find_element(By.ID, "progress").text == "8 / 8 labelled")
    browser.find_elements(By.CSS_SELECTOR, "#overview button")[0].click()
    assert _strict_box(browser) == (True, ["generic_followup"])
    body.send_keys("e")  # nothing missing: no question asked
    exported = _wait(lambda: list(browser.downloads.glob("labels_sam_*.json")))[0]
    data = json.loads(_wait(lambda: exported.read_text() or None))
    got = {r["row"]: (r["label"], r["strict"]) for r in data["rows"]}
    assert [got[k] for k in keys] == [(GENUINE, "generic_followup"), (GENUINE, "yes"), ("new_query", None),
                                      (GENUINE, "empty_or_degenerate")]
    assert sum(v == ("new_query", None) for v in got.values()) == 5

    assert run(_ns(str(run_dir), "--labels", str(exported), "--n-boot", "20")) == 0
    assert "strict given on 3" in capsys.readouterr().out
    stored = {r["row"]: r.get("strict") for r in read_json(run_dir / "audit" / "labels" / "sam.json")["rows"]}
    assert [stored[k] for k in keys] == ["generic_followup", "yes", None, "empty_or_degenerate"]
    rep = read_json(run_dir / "audit" / "report.json")
    (lab,) = rep["labellers"]
    assert lab["strict_given"] == 3 and lab["genuine"] == {"lenient": 3, "strict": 1}
    assert sum(s["audited_genuine"] for s in rep["rates"].values()) == 3
    assert sum(s["strict"]["audited_genuine"] for s in rep["rates"].values()) == 1
    assert sample.sample_id == data["sample_id"]


def test_identify_mode_round_trip(browser, tmp_path, capsys):
    from selenium.webdriver.common.by import By

    run_dir = tmp_path / "run"
    build_run(run_dir, n_steer_items=6, n_probe_items=2)
    assert run(_ns(str(run_dir), "--n", "8", "--by", "condition")) == 0
    capsys.readouterr()
    sample = load_sample(run_dir)
    pairs = {q.row: q for q in load_pairs(run_dir, sample)}
    table = load_run_table(run_dir)

    browser.get((run_dir / "audit" / "identify.html").as_uri())
    body = browser.find_element(By.TAG_NAME, "body")
    assert not browser.find_element(By.ID, "codebook-pane").is_displayed()  # codebook-free
    assert not browser.find_element(By.ID, "query").is_displayed()
    browser.find_element(By.ID, "labeller-name").send_keys("ida")
    body.send_keys("u")
    body.send_keys("p")
    plan = {}
    for i in range(len(pairs)):
        q = pairs[_key(browser)]
        assert browser.find_element(By.ID, "iturn").text.strip() == table.get(q.record_id).turn.strip()
        assert browser.find_element(By.ID, "answer-a").text.strip() == q.a.strip()
        assert browser.find_element(By.ID, "answer-b").text.strip() == q.b.strip()
        choice = q.real if i < 4 else ("3" if i < 6 else {"A": "B", "B": "A"}[q.real])
        plan[q.row] = choice
        body.send_keys({"A": "1", "B": "2"}.get(choice, choice))  # then the next open row opens
    assert browser.find_element(By.ID, "progress").text == f"{len(pairs)} / {len(pairs)} answered"
    body.send_keys("e")
    exported = _wait(lambda: list(browser.downloads.glob("identify_*.json")))[0]
    data = json.loads(_wait(lambda: exported.read_text() or None))
    assert {r["row"]: r["choice"] for r in data["rows"]} == {k: "cant_tell" if v == "3" else v for k, v in plan.items()}

    assert run(_ns(str(run_dir), "--labels", str(exported), "--n-boot", "20")) == 0
    assert "Answer identification" in capsys.readouterr().out
    rep = read_json(run_dir / "audit" / "report.json")
    allrow = next(r for r in rep["identification"]["by_stratum"] if r["stratum"] == "all")
    assert (allrow["labeller"], allrow["n"], allrow["correct"], allrow["cant_tell"]) == ("ida", 8, 4, 2)
