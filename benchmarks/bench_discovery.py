"""What symmetry discovery costs and how exact its checks are.

    python benchmarks/bench_discovery.py [--json out.json] [--families bert,llama,...]

1. The 74 families of ``tests/hf_zoo.py`` (tiny, float64, one batch of 2): per family the
   time of ``find_symmetries`` with and without verification (their difference is the
   cost of verification), the pairs found, the largest relative output change of a
   verified pair under a random transform in its group (cond 10) and the smallest
   change under a transform of ``G`` alone (the checks' power), and the relative change
   of the model's logits when every pair is transformed at once.
2. LLaMA-3-70B's config (80 layers, 64 heads, 8 key/value heads, width 8192) built on
   the ``meta`` device: discovery without weights, best of 5 runs.
3. The attention written by hand of ``tests/attention_zoo.py``: per case the pairs
   found, whether the result is complete, and the time of ``find_symmetries`` (best of 3).

Timings are for one thread; run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from geosharp.symmetry import find_symmetries, random_transforms, transform_parameters


def families(names: list[str] | None) -> list[dict]:
    from hf_zoo import FAMILIES, build, logits_of

    rows = []
    for family in FAMILIES:
        if names and family.name not in names:
            continue
        default = torch.get_default_dtype()
        if family.name == "xglm":  # see tests/test_coverage.py
            torch.set_default_dtype(torch.float64)
        try:
            model, inputs, _ = build(family)
            start = time.perf_counter()
            find_symmetries(model, inputs, verify=False, warn=False)
            unverified = time.perf_counter() - start
            start = time.perf_counter()
            sym = find_symmetries(model, inputs, warn=False)
            total = time.perf_counter() - start
            checks = list(sym.verified.values())
            change = 0.0
            if sym.pairs:
                params = {n: p.detach() for n, p in model.named_parameters()}
                moved = transform_parameters(params, sym.pairs, random_transforms(sym, 10.0, 1))
                with torch.no_grad():
                    a = logits_of(model(**inputs))
                    b = logits_of(torch.func.functional_call(model, moved, (), inputs))
                change = float((b - a).abs().max() / a.abs().max())
        finally:
            torch.set_default_dtype(default)
        rows.append(
            dict(
                family=family.name,
                attention_modules=len(sym.attention),
                pair_blocks=len(sym.pairs),
                pairs=sum(p.shape[0] for p in sym.pairs),
                dropped=len(sym.dropped),
                not_understood=len(sym.unrecognized),
                seconds=total,
                verification_seconds=total - unverified,
                worst_check=max((c.change for c in checks), default=None),
                least_power=min((c.power for c in checks), default=None),
                logits_change=change,
            )
        )
        r = rows[-1]
        print(
            f"{r['family']:<17} {r['attention_modules']:>3} modules {r['pairs']:>4} pairs "
            f"{r['dropped']:>2} dropped  discovery {1e3 * r['seconds']:6.1f} ms (verification "
            f"{1e3 * r['verification_seconds']:5.1f} ms)  check <= {r['worst_check'] or 0:.1e}"
            f"  power >= {r['least_power'] or 0:.1e}  logits {r['logits_change']:.1e}",
            flush=True,
        )
    return rows


def hand_written(repeats: int = 3) -> list[dict]:
    from attention_zoo import CASES, build, loss_fn

    rows = []
    for case in CASES:
        model, x = build(case)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            sym = find_symmetries(model, x, loss_fn=loss_fn, warn=False)
            times.append(time.perf_counter() - start)
        rows.append(
            dict(
                case=case.name, outcome=case.outcome, expect=case.expect,
                pair_blocks=len(sym.pairs), complete=sym.complete,
                exact_drops=sum(d.exact for d in sym.dropped), seconds=min(times),
                groups=sorted(p.group for p in sym.pairs),
            )
        )  # fmt: skip
        r = rows[-1]
        print(
            f"{r['case']:<30} {r['pair_blocks']}/{r['expect']} pair blocks  complete "
            f"{r['complete']!s:<5}  {r['exact_drops']} exact drops  {1e3 * r['seconds']:6.1f} ms",
            flush=True,
        )
    return rows


def meta_70b(repeats: int = 5) -> dict:
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
    )  # fmt: skip
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(config)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sym = find_symmetries(model, warn=False)
        times.append(time.perf_counter() - start)
    heads = sum(p.shape[0] for p in sym.pairs)
    print(
        f"LLaMA-3-70B config on meta: {len(sym.pairs)} pair blocks ({heads} key/value-head "
        f"pairs) in {len(sym.attention)} attention modules, best {min(times):.2f} s, "
        f"median {sorted(times)[len(times) // 2]:.2f} s",
        flush=True,
    )
    return dict(pair_blocks=len(sym.pairs), pairs=heads, seconds=times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the measurements here")
    parser.add_argument("--families", help="comma-separated names (default: all 74)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    names = args.families.split(",") if args.families else None
    out = dict(families=families(names), meta_70b=meta_70b(), hand_written=hand_written())
    rows = out["families"]
    print(
        f"{len(rows)} families: {sum(r['not_understood'] == 0 for r in rows)} with every "
        f"attention module understood; verification median "
        f"{1e3 * sorted(r['verification_seconds'] for r in rows)[len(rows) // 2]:.1f} ms, "
        f"largest check {max(r['worst_check'] or 0 for r in rows):.1e}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
