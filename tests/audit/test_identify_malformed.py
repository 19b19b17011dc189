"""A hand-edited or broken identification export is refused in one line, like a broken codebook-label file.

Why: ``labeller`` given as a string, ``rows`` as an object or a string, or a null row raised AttributeError
(a traceback) where the codebook-label importer names the mistake.
"""

from __future__ import annotations

import argparse
import json

import pytest

from mechprobe.audit import load_sample
from mechprobe.audit.identify import IDENTIFY_FORMAT, load_pairs
from mechprobe.cli.audit import add_args, run
from mechprobe.cli.main import main

from .run_fixture import build_run


def _ns(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(list(argv))


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ident") / "run"
    build_run(run_dir, n_steer_items=4, n_probe_items=2)
    assert run(_ns(str(run_dir), "--n", "6")) == 0
    sample = load_sample(run_dir)
    pairs = load_pairs(run_dir, sample)
    good = {"format": IDENTIFY_FORMAT, "sample_id": sample.sample_id,
            "labeller": {"name": "ida", "kind": "person"},
            "rows": [{"row": pairs[0].row, "choice": "A", "note": ""}]}
    return run_dir, good


@pytest.mark.parametrize("change, needle", [
    ({"labeller": "ida"}, "'labeller'"),
    ({"labeller": ["ida"]}, "'labeller'"),
    ({"rows": {"r1": "A"}}, "'rows'"),
    ({"rows": "A,B"}, "'rows'"),
    ({"rows": [None]}, "row 0"),
    ({"rows": ["A"]}, "row 0"),
    ({"rows": [{"row": ["x"], "choice": "A"}]}, "row"),
    ({"rows": [{"row": "r1", "choice": ["A"]}]}, "choice"),
    ({"labeller": {"name": ["ida"], "kind": "person"}}, "labeller name"),
    ({"labeller": {"name": "ida", "kind": {"k": 1}}}, "labeller kind"),
])
def test_malformed_identify_export_is_one_line_exit_2(audited, tmp_path, capsys, change, needle):
    run_dir, good = audited
    f = tmp_path / "ida.json"
    f.write_text(json.dumps({**good, **change}))
    capsys.readouterr()
    assert main(["audit", str(run_dir), "--labels", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err and "Error" not in err
    assert not (run_dir / "audit" / "identify_labels").exists()  # nothing stored


def test_the_good_export_still_imports(audited, tmp_path, capsys):
    run_dir, good = audited
    f = tmp_path / "ida.json"
    f.write_text(json.dumps(good))
    assert main(["audit", str(run_dir), "--labels", str(f), "--n-boot", "20"]) == 0
    assert (run_dir / "audit" / "identify_labels" / "ida.json").exists()
