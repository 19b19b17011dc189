"""Label files that would corrupt the audit are refused with one line naming the problem and the fix."""

from __future__ import annotations

import json

import pytest

from mechprobe.audit import import_labels, load_or_draw, load_run_table, read_labels_file
from mechprobe.errors import UsageError

from .run_fixture import build_run


@pytest.fixture()
def setup(tmp_path):
    build_run(tmp_path / "run", n_steer_items=6, n_probe_items=2)
    sample, _ = load_or_draw(tmp_path / "run", load_run_table(tmp_path / "run"), 8, "condition", 0)
    return tmp_path, sample


def _export(tmp_path, sample, rows, name="ann", kind="person", sample_id=None, fname=None):
    p = tmp_path / (fname or f"{name}.json")
    p.write_text(json.dumps({"format": "mechprobe-audit-labels-v1", "sample_id": sample_id or sample.sample_id,
                             "labeller": {"name": name, "kind": kind},
                             "rows": [{"row": k, "label": v, "borderline": False, "note": ""} for k, v in rows]}))
    return p


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_row_not_in_sample(setup):
    tmp, sample = setup
    rows = [(k, "new_query") for k in sample.keys()] + [("rdeadbeef00", "new_query")]
    with pytest.raises(UsageError) as e:
        import_labels(tmp / "run", [_export(tmp, sample, rows)], sample)
    assert "not in the run's sample" in _one_line(e) and "rdeadbeef00" in str(e.value)
    assert not (tmp / "run" / "audit" / "labels").exists()


def test_unknown_label(setup):
    tmp, sample = setup
    rows = [(k, "genuine") for k in sample.keys()]
    with pytest.raises(UsageError) as e:
        import_labels(tmp / "run", [_export(tmp, sample, rows)], sample)
    assert "unknown label 'genuine'" in _one_line(e) and "genuine_followup" in str(e.value)


def test_unknown_label_in_csv(setup, tmp_path):
    _, sample = setup
    p = tmp_path / "carl.csv"
    k = next(iter(sample.keys()))
    p.write_text(f"sample_id,row,label,borderline\n{sample.sample_id},{k},Genuine_Followup,\n")
    with pytest.raises(UsageError, match=r"carl.csv:2: unknown label"):
        read_labels_file(p, kind="person")


def test_other_sample_duplicate_names_and_kinds(setup):
    tmp, sample = setup
    keys = list(sample.keys())
    with pytest.raises(UsageError, match="label the run's current sheet.html"):
        import_labels(tmp / "run", [_export(tmp, sample, [(keys[0], "new_query")], sample_id="sother")], sample)
    first = _export(tmp, sample, [(k, "new_query") for k in keys])
    assert import_labels(tmp / "run", [first], sample)[0].name == "ann.json"
    assert import_labels(tmp / "run", [first], sample)  # the same content again: no-op
    other = _export(tmp, sample, [(k, "generic_followup") for k in keys], fname="ann2.json")
    with pytest.raises(UsageError) as e:
        import_labels(tmp / "run", [other], sample)
    assert "already holds different labels by 'ann'" in _one_line(e)
    with pytest.raises(UsageError, match="same labeller 'ann'"):
        import_labels(tmp / "run", [first, other], sample)
    with pytest.raises(UsageError, match="labeller_kind="):
        read_labels_file(first, kind="model")
    nokind = _export(tmp, sample, [(keys[0], "new_query")], name="bo", kind="")
    with pytest.raises(UsageError, match="pass labeller_kind=person or model"):
        read_labels_file(nokind)
    assert read_labels_file(nokind, kind="model").kind == "model"
    dup = _export(tmp, sample, [(keys[0], "new_query"), (keys[0], "new_query")], name="cy")
    with pytest.raises(UsageError, match="labelled twice"):
        read_labels_file(dup)
    bad = _export(tmp, sample, [(keys[0], "new_query")], name="../evil")
    with pytest.raises(UsageError, match="labeller name"):
        read_labels_file(bad)
