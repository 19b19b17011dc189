"""The judge registry: a judge kind is one module with ``@register_judge``; the factory, the spec checks, the
``--judge`` help and the commands' option routing all read it, and ``auto``/None resolve in one function."""

from __future__ import annotations

import pytest

from mechprobe.cli.common import JUDGE_HELP
from mechprobe.errors import UsageError
from mechprobe.judges import registry
from mechprobe.judges.agreement import is_judge_spec
from mechprobe.judges.factory import check_judge_spec, make_judge, spec_of_judge_name
from mechprobe.judges.registry import JudgeSpec, judge_help, judge_kinds, register_judge


class _EchoJudge:
    """A judge that labels nothing: enough to see what the factory handed its constructor."""

    def __init__(self, model: str, **opts) -> None:
        self.name, self.model, self.opts = f"echo:{model}@echo-v1", model, opts


@pytest.fixture
def echo_kind(monkeypatch):
    """Register an ``echo:MODEL`` kind the way a new judge module would, and remove it afterwards."""
    monkeypatch.setattr(registry, "_KINDS", dict(registry._KINDS))
    monkeypatch.setattr(registry, "_ALIASES", dict(registry._ALIASES))

    @register_judge("echo", options=("threshold",), help="test judge", example="m",
                    spec_of_name=lambda n: "echo:" + n.split(":", 1)[1].split("@")[0] if n.startswith("echo:") else None)
    def echo(spec: JudgeSpec, **opts):
        return _EchoJudge(spec.model, **opts)
    return echo


def test_a_registered_kind_is_built_checked_routed_and_listed(echo_kind):
    j = make_judge("echo:m", threshold=0.3, base_url="http://x", concurrency=None)
    assert isinstance(j, _EchoJudge) and j.model == "m" and j.opts == {"threshold": 0.3}  # only its options
    assert check_judge_spec("echo:m") == "echo:m" and is_judge_spec("echo:m")
    assert "echo:MODEL" in judge_help() and "echo" in judge_kinds()
    assert spec_of_judge_name("echo:m@echo-v1") == "echo:m"  # auto resumes a run labelled by it
    with pytest.raises(UsageError, match=r"echo:MODEL needs a model name, e\.g\. echo:m"):
        make_judge("echo:")
    with pytest.raises(UsageError, match="registered twice"):
        register_judge("echo")(lambda spec, **o: None)


def test_the_judge_help_lists_every_kind_and_the_spec_is_parsed_once():
    for form in ("offline", "offline-lexical", "offline-embed", "hybrid:MODEL", "hybrid-voice:MODEL (alias "
                 "hybrid2:MODEL)", "trained:MODEL", "local:MODEL", "openai:MODEL"):
        assert form in JUDGE_HELP
    assert JUDGE_HELP.endswith("else offline)") and "auto (default)" in JUDGE_HELP
    s = JudgeSpec.parse("hybrid2:qwen2.5-coder-1.5b-instruct")
    assert (s.kind, s.model, str(s)) == ("hybrid-voice", "qwen2.5-coder-1.5b-instruct",
                                         "hybrid-voice:qwen2.5-coder-1.5b-instruct")
    with pytest.raises(UsageError, match="takes no model"):
        JudgeSpec.parse("offline:x")
    with pytest.raises(UsageError, match="judge='bogus': unknown judge"):
        JudgeSpec.parse("bogus")


def test_recorded_judge_names_are_unchanged():
    """Caches and reports are keyed by the judge's recorded name: the registry must not rename any."""
    assert make_judge("offline-lexical").name == "offline-v3+lexical"
    assert spec_of_judge_name("hybrid:m@hybrid-v2+voice0.1+offline-v3+minilm") == "hybrid-voice:m"
    assert spec_of_judge_name("hybrid:m@hybrid-v2+offline-v3+minilm") == "hybrid:m"
    assert spec_of_judge_name("trained:m@trained-v1+offline-v3+minilm") == "trained:m"
    assert spec_of_judge_name("offline-v3+minilm") == "offline"


def test_judge_help_names_the_packaged_weights_of_the_research_default():
    """``--help`` names the fit ``auto`` runs, read from the weights file the judge loads (never a typed version)."""
    import json

    from mechprobe.judges.hidden import weights_path

    version = json.loads(weights_path(registry.BEST_JUDGE.split(":", 1)[1]).read_text(encoding="utf-8"))["version"]
    assert f"{registry.BEST_JUDGE} at weights {version}," in JUDGE_HELP
