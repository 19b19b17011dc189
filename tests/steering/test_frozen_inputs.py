"""Split files and a steering directory's frozen setting that are malformed are refused in one line."""

from __future__ import annotations

import json

import pytest

from mechprobe.errors import UserError
from mechprobe.splits import STEERING_SPLIT, load_split
from mechprobe.steering.experiment import SETTING_FILE, check_setting, freeze_setting


def _split(tmp_path, **edit):
    d = json.loads(STEERING_SPLIT.read_text()) | edit
    for k in [k for k, v in edit.items() if v is None]:
        del d[k]
    p = tmp_path / "split.json"
    p.write_text(json.dumps(d))
    return p


def test_the_package_split_loads():
    s = load_split(STEERING_SPLIT)
    assert s.heldout and s.train and not set(s.heldout) & set(s.train)


@pytest.mark.parametrize("edit, needle", [
    (lambda d: {"heldout": d["heldout"] + d["heldout"][:1]}, "repeat in 'heldout'"),
    (lambda d: {"train": d["train"] + d["train"][-1:]}, "repeat in 'train'"),
    (lambda d: {"train": None}, "'train' is missing"),
    (lambda d: {"heldout": []}, "'heldout' list is empty"),
    (lambda d: {"heldout": "gsm8k-0001"}, "'heldout' is missing or not a list"),
    (lambda d: {"train": [1, 2]}, "'train' is missing or not a list"),
    (lambda d: {"name": None}, "'name'"),
])
def test_malformed_split_is_one_line(tmp_path, edit, needle):
    d = json.loads(STEERING_SPLIT.read_text())
    p = _split(tmp_path, **edit(d))
    with pytest.raises(UserError, match=needle) as e:
        load_split(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_split_that_is_not_utf8(tmp_path):
    p = tmp_path / "split.json"
    p.write_bytes(b'{"format": "\xff"}')
    with pytest.raises(UserError, match="not JSON"):
        load_split(p)


@pytest.mark.parametrize("text", ["[1, 2]", '"frozen"', '{"setting": [1], "sha256": "x"}', "null"])
def test_setting_json_that_is_not_an_object(tmp_path, text):
    (tmp_path / SETTING_FILE).write_text(text)
    with pytest.raises(UserError, match="not a frozen setting") as e:
        freeze_setting(tmp_path, {"kinds": ["diff_of_means"]})
    assert "steer_dir=" in str(e.value) and "\n" not in str(e.value)
    assert (tmp_path / SETTING_FILE).read_text() == text  # left as it was


def test_a_good_setting_still_freezes_and_checks(tmp_path):
    freeze_setting(tmp_path, {"kinds": ["a"]})
    check_setting(tmp_path, {"kinds": ["a"]})
    with pytest.raises(UserError, match="frozen at kinds"):
        check_setting(tmp_path, {"kinds": ["b"]})
