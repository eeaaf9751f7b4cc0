"""Cost of one Auto-PGD step relative to one forward+backward of the same model.

The time of one step is measured as ``(T(n_long) - T(n_short)) / (n_long - n_short)``
for a full :func:`geosharp.sharpness` call (set-up cost cancels), next to the time of
one plain ``loss.backward()`` on the same batch; every timing is the median of
``--repeats`` interleaved runs, so that load from other processes hits both alike.

    python benchmarks/bench_step.py               # demo ViT (digits-sized)
    python benchmarks/bench_step.py --model minilm --batch 32 --seq 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn import functional as F

import geosharp


def build(name: str, batch: int, seq: int):
    gen = torch.Generator().manual_seed(0)
    if name == "demo-vit":
        from geosharp.models.vit import image_loss, tiny_vit

        model = tiny_vit()
        data = (torch.rand(batch, 1, 8, 8, generator=gen), torch.randint(0, 10, (batch,)))
        return model, data, image_loss
    if name == "minilm":
        from geosharp.loading.hf import load_classifier

        loaded = load_classifier("minilm")
        model, config = loaded.model, loaded.config
    elif name == "bert-base-shaped":
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(num_labels=2)  # hidden 768, 12 heads of 64, 12 layers
        model = BertForSequenceClassification(config)
    else:
        raise SystemExit(f"unknown model {name}")
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen)
    data = (ids, torch.randint(0, 2, (batch,), generator=gen))

    def loss_fn(m, b):
        return F.cross_entropy(m(input_ids=b[0]).logits, b[1])

    return model.eval(), data, loss_fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="demo-vit", choices=["demo-vit", "minilm", "bert-base-shaped"]
    )
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--short", type=int, default=2)
    parser.add_argument("--long", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    model, batch, loss_fn = build(args.model, args.batch, args.seq)
    symmetries = geosharp.find_symmetries(model)
    measures = ("adaptive", "geodesic-inv", "geodesic-mix")  # names of geosharp's table

    def fwd_bwd() -> float:
        start = time.perf_counter()
        loss_fn(model, batch).backward()
        elapsed = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        return elapsed

    def run(name, n) -> float:
        start = time.perf_counter()
        geosharp.sharpness(
            model,
            [batch],
            loss_fn,
            measure=name,
            rho=0.001,
            symmetries=symmetries,
            estimator=geosharp.WorstCase(n_iters=n),
        )
        return time.perf_counter() - start

    fwd_bwd()  # warm-up
    base, steps = [], {k: [] for k in measures}
    for _ in range(args.repeats):
        base.append(fwd_bwd())
        for name in measures:
            t_long, t_short = run(name, args.long), run(name, args.short)
            steps[name].append((t_long - t_short) / (args.long - args.short))
    ref = statistics.median(base)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model {args.model}: {n_params:,} parameters, batch {args.batch}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print(f"{'':<16} {'seconds':>9} {'x fwd+bwd':>10}")
    print(f"{'forward+backward':<16} {ref:>9.4f} {1.0:>10.2f}")
    adaptive = statistics.median(steps["adaptive"])
    for name, times in steps.items():
        t = statistics.median(times)
        extra = f"   ({t / adaptive:.2f}x adaptive)" if name != "adaptive" else ""
        print(f"{'step ' + name:<16} {t:>9.4f} {t / ref:>10.2f}{extra}")


if __name__ == "__main__":
    main()
