"""The judges the package's defaults name are written once, in the judge registry.

``BEST_JUDGE`` (the research default, what ``auto`` picks where its model is fetched) and ``OFFLINE_JUDGE`` (the
default of what must run anywhere: ``StudyConfig``, ``make_judge``, ``judge_run``) live in
:mod:`mechprobe.judges.registry`; a config or function default elsewhere imports them instead of spelling the
spec again, so changing the research default is one line.
"""

from __future__ import annotations

import ast
from pathlib import Path

from mechprobe.judges import factory
from mechprobe.judges.registry import BEST_JUDGE, OFFLINE_JUDGE, JudgeSpec, judge_kinds
from mechprobe.post_train.config import PostTrainConfig
from mechprobe.study.run import StudyConfig
from tests.architecture.test_layers import PKG

# Where a judge spec may be spelled as a literal default: the registry itself and each kind's own module.
ALLOWED = {"judges/registry.py"}


def literal_judge_defaults(root: Path) -> list[str]:
    """``path:line spec`` of every parameter default or class-level field default that is a judge spec literal
    (a registered kind, or ``KIND:MODEL`` of one), outside :data:`ALLOWED` and ``judges/kinds/``."""
    kinds = set(judge_kinds())

    def is_spec(v: object) -> bool:
        return isinstance(v, str) and (v in kinds or v.split(":", 1)[0] in kinds and ":" in v)

    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in ALLOWED or rel.startswith("judges/kinds/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            values: list[ast.expr | None] = []
            if isinstance(node, ast.arguments):
                values = [*node.defaults, *node.kw_defaults]
            elif isinstance(node, ast.ClassDef):
                values = [n.value for n in node.body if isinstance(n, ast.AnnAssign | ast.Assign)]
            for v in values:
                if isinstance(v, ast.Constant) and is_spec(v.value):
                    found.append(f"{rel}:{v.lineno} {v.value}")
    return found


def test_the_default_judges_are_registered_specs():
    assert JudgeSpec.parse(BEST_JUDGE).kind in judge_kinds()
    assert JudgeSpec.parse(OFFLINE_JUDGE).kind in judge_kinds() and JudgeSpec.parse(OFFLINE_JUDGE).model is None


def test_configs_take_their_judge_defaults_from_the_registry(monkeypatch):
    assert StudyConfig().judge == OFFLINE_JUDGE
    assert PostTrainConfig().judge is None  # resolved by the default-judge rule, which names BEST_JUDGE
    monkeypatch.setattr(factory, "model_unavailable", lambda model: None)
    monkeypatch.delenv("MECHPROBE_JUDGE_MODEL", raising=False)
    assert factory.default_judge("qwen2.5-coder-0.5b-instruct") == BEST_JUDGE
    monkeypatch.setattr(factory, "model_unavailable", lambda model: "not fetched")
    assert factory.default_judge("qwen2.5-coder-0.5b-instruct") == OFFLINE_JUDGE


def test_no_default_spells_a_judge_spec_outside_the_registry():
    assert literal_judge_defaults(PKG) == []


def test_the_checker_sees_a_literal_default(tmp_path):
    (tmp_path / "study").mkdir()
    (tmp_path / "study" / "run.py").write_text(
        "class StudyConfig:\n    judge: str = 'offline'\n\n"
        "def evaluate(judge='hybrid-voice:qwen2.5-coder-1.5b-instruct', engine='hf'):\n    pass\n")
    assert literal_judge_defaults(tmp_path) == ["study/run.py:2 offline",
                                                "study/run.py:4 hybrid-voice:qwen2.5-coder-1.5b-instruct"]
