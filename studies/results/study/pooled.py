"""The exploratory pooled estimate over the three study populations (not part of the
package, not pre-registered): the mean over populations of |tau(geodesic)| -
|tau(adaptive)| with the error gap at each population's calibrated radius, with a
bootstrap stratified by population. Reads each population's ``models.csv`` and the
protocol in its ``endpoints.json``; writes ``pooled.json``. Run from the repository
root: ``python studies/results/study/pooled.py``."""

from __future__ import annotations

import json
from pathlib import Path

from geosharp.io import write_json_atomic
from geosharp_studies.endpoints import Protocol, pooled_difference
from geosharp_studies.zoo.report import rows_from_table

HERE = Path(__file__).parent
POPULATIONS = ("seeds", "vision-finetune", "hparams")
N_BOOT, SEED = 2000, 1


def studies() -> list:
    out = []
    for name in POPULATIONS:
        rows = rows_from_table((HERE / name / "models.csv").read_text())
        protocol = json.loads((HERE / name / "endpoints.json").read_text())["protocol"]
        protocol["compared"] = tuple(protocol.get("compared") or ())
        out.append((rows, Protocol(**protocol)))
    return out


def paper_differences() -> dict:
    """The paper's |tau(geodesic)| - |tau(adaptive)| per setting (the measure table)."""
    from geosharp.measures import TABLE

    ref = TABLE["adaptive"].paper_tau
    return {
        m: {k: abs(TABLE[m].paper_tau[k]) - abs(ref[k]) for k in ("clip", "bert")}
        for m in ("geodesic-inv", "geodesic-mix")
    }


def pooled() -> dict:
    data = studies()
    paper = paper_differences()
    out = {}
    for m in ("geodesic-inv", "geodesic-mix"):
        out[m] = pooled_difference(data, m, "adaptive", n_boot=N_BOOT, seed=SEED)
        out[m]["per_population"] = {k: float(v) for k, v in out[m]["per_population"].items()}
        out[m]["paper"] = paper[m]
        out[m]["excludes_paper"] = out[m]["ci"][1] < min(paper[m].values())
    return out


if __name__ == "__main__":
    result = pooled()
    write_json_atomic(HERE / "pooled.json", result)
    for m, r in result.items():
        print(
            m, f"{r['estimate']:+.3f} [{r['ci'][0]:+.3f}, {r['ci'][1]:+.3f}]", r["per_population"]
        )
