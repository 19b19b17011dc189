"""What a steering directory freezes: the requested setting, the steering vector and the NLL dtype.

Held-out numbers in one steering directory must come from one setting, one vector and one scoring dtype; each
is pinned on first use and checked on every later run, so a re-run with a tweaked setting is refused, not mixed in.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from mechprobe.errors import UserError
from mechprobe.io import read_json, write_json
from mechprobe.splits import ItemSplit
from mechprobe.steering.config import SteerConfig
from mechprobe.steering.vector import SteeringVector

SETTING_FILE = "setting.json"


def requested_setting(a: SteerConfig, alphas: list[float], split: ItemSplit | None) -> dict[str, Any]:
    """What the command asks for, before anything is chosen: the keys a steering directory freezes."""
    return {"alpha_unit": a.alpha_unit, "requested_alphas": sorted({float(x) for x in alphas}),
            "requested_layers": [a.layer] if a.layer is not None else a.candidate_layers,
            "select_on_train": a.select_on_train, "select_items": a.select_items if a.select_on_train else None,
            "max_degenerate": a.max_degenerate if a.select_on_train else None,
            "kinds": a.kinds.split(","), "positions": a.positions, "judge": a.judge,
            "split": ({"name": split.name, "sha256": split.sha256} if split is not None
                      else "hash split (mechprobe.splits.split_of)")}


def _setting_sha(setting: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(setting, sort_keys=True).encode()).hexdigest()


def check_setting(out_dir: Path, setting: dict[str, Any]) -> None:
    """Refuse ``setting`` when ``out_dir/setting.json`` froze another value of one of its keys (one line naming
    the key and the fix). A directory without the file (new, or from an older version) passes."""
    p = out_dir / SETTING_FILE
    if not p.exists():
        return
    d = read_json(p)
    if not isinstance(d, dict) or not isinstance(d.get("setting"), dict):
        raise UserError(f"{p} is not a frozen setting (a JSON object with a 'setting' object); restore it, or pass "
                        f"steer_dir=NEW_DIR for a fresh steering directory")
    old = d["setting"]
    if d.get("sha256") != _setting_sha(old):
        raise UserError(f"{p} was edited by hand (its sha256 no longer matches its setting); restore it, or pass "
                        f"steer_dir=NEW_DIR for a fresh steering directory")
    for k, v in setting.items():
        if k in old and old[k] != v:
            raise UserError(f"{out_dir} is frozen at {k}={json.dumps(old[k])} ({p}), this run asks for {k}="
                            f"{json.dumps(v)}: held-out items are steered at one setting per directory; pass "
                            f"steer_dir=NEW_DIR to run another setting")


def freeze_setting(out_dir: Path, setting: dict[str, Any]) -> str:
    """Write ``out_dir/setting.json`` (setting + sha256) on first use, else check it; returns the sha256.

    Why: (layer, alpha unit, alphas, kinds, positions, judge) are chosen on train items; held-out numbers mean
    something only if no held-out result ever fed back into that choice. Freezing the choice before the held-out
    stage, and refusing a second setting in the same directory, makes a re-run with a tweaked setting visible.
    """
    p = out_dir / SETTING_FILE
    check_setting(out_dir, setting)
    if p.exists():
        old = read_json(p)["setting"]
        missing = sorted(set(setting) - set(old))
        if missing:
            raise UserError(f"{p} lacks {missing[0]} (written by an older version); pass steer_dir=NEW_DIR")
        return _setting_sha(old)
    write_json(p, {"setting": setting, "sha256": _setting_sha(setting)})
    return _setting_sha(setting)


def pin_vector(base: Path, vec: SteeringVector, turns_dir: Path | None = None) -> None:
    """Save ``vec`` at ``base`` (.safetensors/.json), or check it equals the one saved there.

    Why: steered turns are stored per (layer, kind, alpha), not per vector. The vector is a difference of means
    over *judged* train rows, so relabelling the run with another judge changes it; turns generated with the old
    vector must then not be reused as if they came from the new one. Tolerance: rtol 1e-4 of the vector's norm,
    far above float summation-order noise of a mean over a few hundred rows, far below any change of labels.
    """
    st = base.with_name(base.name + ".safetensors")
    if st.exists():
        old = SteeringVector.load(base).vector.float()
        new = vec.vector.detach().float().cpu()
        if old.shape != new.shape or float((old - new).norm()) > 1e-4 * max(float(new.norm()), 1e-12):
            raise UserError(f"{st} holds another steering vector than the one built now (the run's labels or cache "
                            f"changed since, e.g. a relabel with another judge), so the turns stored beside it are "
                            f"not this vector's. Pass steer_dir=NEW_DIR for a fresh steering directory, or move "
                            f"{base.parent} aside")
        return
    made = sorted(turns_dir.glob("alpha_*.jsonl")) if turns_dir is not None and turns_dir.is_dir() else []
    if made:
        raise UserError(f"{turns_dir} holds steered turns ({made[0].name}, ...) but no record of the vector that made "
                        f"them (a steering directory from an older version), so they cannot be checked against the "
                        f"vector built now. Pass steer_dir=NEW_DIR, or move {turns_dir} aside")
    vec.save(base)


def pin_nll_dtype(out_dir: Path, wanted: str | None, legacy: str | None) -> str | None:
    """The dtype of the HF model that scores NLLs in ``out_dir``, pinned in ``nll.json`` on first use.

    Why: one table compares NLLs across conditions, and bf16 and fp32 scores of the same text differ by
    ~0.01 per token (1.5B model), a tenth of the smallest steering effect reported; a resumed run must not
    mix them. A directory with steered turns but no pin was scored by the run's own model (``legacy``).
    ``None`` means the model's default dtype.
    """
    pin = out_dir / "nll.json"
    if pin.exists():
        dt = read_json(pin)["dtype"]
        if dt != wanted:
            print(f"note: NLLs in {out_dir} were scored in {dt or 'the default dtype'}; kept for this run")
        return dt
    dt = legacy if any(out_dir.rglob("alpha_*.jsonl")) else wanted
    write_json(pin, {"dtype": dt})
    return dt
