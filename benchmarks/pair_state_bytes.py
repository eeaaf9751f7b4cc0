"""What a geodesic measure's pair states hold: the bytes of their ``h x h`` matrices,
against the model's float32 size and, per process of an FSDP2 run that shards every
head's rows (``geosharp.fsdp.shard``), against the local shard: the states are whole on
every process there.

    python benchmarks/pair_state_bytes.py [--out out.json]

Per model (the FSDP benchmark's 14M BERT, ``bench_fsdp.py --model bert-384``, and
BERT-base's shape, float32, built from their configs) and metric (``inv``, ``mix``):
one ``geosharp.sharpness`` call of one Auto-PGD step, after which every tensor the
states hold (each storage once) is counted, by name: what they hold through the forward
and backward between the step's passes over the pairs. Copies in the tangent's dtype
that a state keeps are included (d80ddd6 cached four in ``_casts`` for good; a state now
makes them per pass and frees them at its end).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODELS = ("bert-384", "bert-base")  # of bench_fsdp.MODELS


def held(state) -> dict[str, int]:
    """``{name: bytes}`` of the tensors ``state`` holds, each storage once."""
    import torch

    seen: dict[int, tuple[str, int]] = {}
    for key, value in vars(state).items():
        items = [(key, value)] if isinstance(value, torch.Tensor) else []
        if key in ("_casts", "_pass") and value:  # copies: {(name, dtype): tensor}
            items = [(f"{n} ({str(d).removeprefix('torch.')})", t) for (n, d), t in value.items()]
        for name, t in items:
            storage = t.untyped_storage()
            seen.setdefault(storage.data_ptr(), (name, storage.nbytes()))
    out: dict[str, int] = {}
    for name, nbytes in seen.values():
        out[name] = out.get(name, 0) + nbytes
    return out


def measure(model_name: str, metric: str) -> dict:
    import geosharp
    from bench_fsdp import bert
    from geosharp.geometry import stacked

    model, batch = bert(model_name, batch=2)
    model.eval()

    def loss_fn(m, b):
        return m(**b).loss

    spaces = []
    original = stacked.PairSpace.set_states

    def set_states(self, params):
        original(self, params)
        spaces.append(self)

    stacked.PairSpace.set_states = set_states
    try:
        geosharp.sharpness(
            model,
            [batch],
            loss_fn,
            f"geodesic-{metric}",
            rho=0.01,
            estimator=geosharp.WorstCase(n_iters=1),
        )
    finally:
        stacked.PairSpace.set_states = original
    by_name: dict[str, int] = {}
    for block in spaces[-1].blocks:
        for name, nbytes in held(block.state).items():
            by_name[name] = by_name.get(name, 0) + nbytes
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    total = sum(by_name.values())
    pairs = sum(block.g_index.shape[0] for block in spaces[-1].blocks)  # heads
    return {
        "model": model_name,
        "metric": metric,
        "pairs": pairs,
        "h": spaces[-1].blocks[0].state.h,
        "model_bytes": model_bytes,
        "state_bytes": total,
        "of_model": round(total / model_bytes, 4),
        "per_process_of_4": round(4 * total / model_bytes, 3),
        "by_name": dict(sorted(by_name.items(), key=lambda kv: -kv[1])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    args = parser.parse_args()
    import warnings

    warnings.simplefilter("ignore")
    rows = []
    print("model      metric  pairs  h   states MiB  of model  per process of 4  held")
    for model_name in MODELS:
        for metric in ("inv", "mix"):
            r = measure(model_name, metric)
            rows.append(r)
            names = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in r["by_name"].items())
            print(
                f"{r['model']:9s}  {metric:6s}  {r['pairs']:5d}  {r['h']:2d}  "
                f"{r['state_bytes'] / 2**20:10.2f}  {r['of_model']:8.4f}  "
                f"{r['per_process_of_4']:16.3f}  {names}",
                flush=True,
            )
    if args.out is not None:
        args.out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
