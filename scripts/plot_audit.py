"""Judge-only vs audit-corrected follow-up rates from one or more ``audit/report.json`` files, as one figure.

    python scripts/plot_audit.py --model qwen2.5-coder-0.5b-instruct --out figures/audit_qwen2.5-coder-0.5b-instruct.png \\
        gsm8k=reports/audit/qwen2.5-coder-0.5b-instruct-gsm8k/report.json \\
        mt_bench=reports/audit/qwen2.5-coder-0.5b-instruct-mt_bench/report.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mechprobe.judges.factory import spec_of_judge_name  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", help="NAME=path/to/report.json")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    fig, axes = plt.subplots(1, len(a.reports), figsize=(max(4.2 * len(a.reports), 6.4), 3.9), squeeze=False)
    judge = labellers = ""
    for ax, spec in zip(axes[0], a.reports, strict=True):
        name, path = spec.split("=", 1)
        rep = json.loads(Path(path).read_text())
        judge = rep["sample"].get("judges", [""])[0] if isinstance(rep["sample"].get("judges"), list) else ""
        labellers = ", ".join(f"{x['name']} ({x['kind']})" for x in rep["labellers"])
        strata = sorted(rep["rates"])
        for j, (key, colour, lab) in enumerate([("judge_only", "tab:gray", "judge only"),
                                                ("corrected", "tab:blue", "corrected (audit)")]):
            xs = [i + (j - 0.5) * 0.3 for i in range(len(strata))]
            pts = [rep["rates"][s][key]["point"] for s in strata]
            err = [[pt - rep["rates"][s][key]["lo"] for s, pt in zip(strata, pts, strict=True)],
                   [rep["rates"][s][key]["hi"] - pt for s, pt in zip(strata, pts, strict=True)]]
            ax.errorbar(xs, pts, yerr=err, fmt="o", color=colour, capsize=4, label=lab)
        ax.set_xticks(range(len(strata)))
        ax.set_xticklabels([f"{s}\nn={rep['rates'][s]['n_turns']} turns, {rep['rates'][s]['n_audited']} audited"
                            for s in strata], fontsize=8)
        ax.set_ylim(0, max(0.3, ax.get_ylim()[1]))
        ax.set_ylabel("genuine follow-up rate")
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=8)
    spec = spec_of_judge_name(judge) or judge
    fig.suptitle(f"{a.model}: judge {spec}\nvs blind audit ({labellers})\n95% CIs; corrected = "
                 "prediction-powered (ppi_py)", fontsize=9)
    fig.tight_layout()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
