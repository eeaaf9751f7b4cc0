"""One perturbed bfloat16 linear layer, forward and backward, timed three ways side by
side: its products split into bfloat16 parts (``split_product``), in float32 (as
before the split), and a bfloat16 training step's layer (no perturbation).

    python benchmarks/split_layer.py [--tokens 128 1024] [--width 2048] [--threads 2]

The split makes about six elementwise passes over the weight that do not grow with the
tokens; the products do. Median of 5 runs after one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from geosharp.measures.backends.split import split_product


def timings(tokens: int, width: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    weight = (0.02 * torch.randn(width, width, generator=g)).bfloat16()
    point = weight.float() * (1 + 0.05 * torch.randn(width, width, generator=g))
    point.requires_grad_(True)
    x = torch.randn(tokens, width, generator=g).bfloat16().requires_grad_(True)
    grad = torch.randn(tokens, width, generator=g).bfloat16()

    def split():
        split_product(x, weight.t(), point.t()).bfloat16().backward(grad)

    def float32():
        F.linear(x.float(), point).bfloat16().backward(grad)

    def step():
        F.linear(x, weight.detach().requires_grad_(True)).backward(grad)

    out = {}
    for name, run in (("split", split), ("float32", float32), ("bfloat16 step", step)):
        run()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for tokens in args.tokens:
        t = timings(tokens, args.width)
        print(f"{tokens:5d} tokens, width {args.width}: "
              + ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in t.items())
              + f"; split / float32 {t['split'] / t['float32']:.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
