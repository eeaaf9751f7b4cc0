"""One Auto-PGD step against one forward+backward as the tokens per batch grow.

The step's own work (retraction, pullback, direction, combination) is linear in the
perturbed parameters; a forward+backward is linear in parameters x tokens. So the ratio
falls toward 1 as batches grow. Measured on a BERT-base-shaped encoder (110M parameters,
float32, random weights, eager attention), 128 tokens per sequence, 2 CPU threads, in
one process, interleaved so that load from elsewhere hits both alike:

    python benchmarks/step_trend.py --batches 2 8 16 [--json out.json]

Per batch size and measure: the median forward+backward (``loss.backward()`` with
gradients of every parameter, as the measure takes them), the median time between two
evaluations of the measure (one step: forward, backward, pullback, step, retraction),
and their ratio (the step through ``sharpness(..., callback=...)``); and the steadier
ratio ``(forward+backward + loop) / forward+backward`` with the loop's own work timed
inside the call (from the end of one evaluation to the start of the next), which the
whole step's timing noise (a forward+backward moves by several percent between calls)
does not reach. ``--device cuda`` runs the same on a GPU, every timestamp taken after
``torch.cuda.synchronize``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time


def _model():
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.BertConfig(num_labels=2, attn_implementation="eager")
    return tf.BertForSequenceClassification(config).eval(), config


def measure_batch(
    model, config, batch: int, tokens: int, measures, n_iters: int, repeats: int, device="cpu"
):  # fmt: skip
    import torch

    import geosharp

    def now() -> float:
        if device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter()

    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, config.vocab_size, (batch, tokens), generator=gen).to(device)
    labels = torch.zeros(batch, dtype=torch.long, device=device)
    data = [{"input_ids": ids, "labels": labels}]

    def loss(m, b):
        return m(**b).loss

    symmetries = geosharp.find_symmetries(model, data[0], loss_fn=loss)
    plain, steps, loops = [], {m: [] for m in measures}, {m: [] for m in measures}
    for _ in range(repeats):
        start = now()
        loss(model, data[0]).backward()
        plain.append(now() - start)
        model.zero_grad(set_to_none=True)
        for measure in measures:
            done: list[float] = []
            begun: list[float] = []

            def callback(event, i, iterate, done=done, begun=begun):
                if event == "evaluated":
                    done.append(now())
                elif event == "evaluate" and done:
                    begun.append(now())

            geosharp.sharpness(
                model, data, loss, measure, None, geosharp.WorstCase(n_iters),
                symmetries=symmetries, callback=callback,
            )  # fmt: skip
            steps[measure] += [b - a for a, b in itertools.pairwise(done)]
            loops[measure] += [b - a for a, b in zip(done, begun)]
    fb = statistics.median(plain)
    rows = []
    for measure in measures:
        step, loop = statistics.median(steps[measure]), statistics.median(loops[measure])
        row = dict(measure=measure, batch=batch, tokens=tokens, tokens_per_batch=batch * tokens)
        row |= {"forward_backward_s": fb, "step_s": step, "ratio": step / fb}
        rows.append(row | {"loop_s": loop, "steady_ratio": (fb + loop) / fb})
    return rows


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[2, 8, 16])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--n-iters", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(2)
    model, config = _model()
    model.to(args.device)
    rows = []
    for batch in args.batches:
        for r in measure_batch(
            model, config, batch, args.tokens, ("adaptive", "geodesic-inv"),
            args.n_iters, args.repeats, args.device,
        ):  # fmt: skip
            rows.append(r)
            print(
                f"{r['measure']:<13} {r['batch']:>3} x {r['tokens']} tokens: forward+backward "
                f"{r['forward_backward_s']:.2f} s, step {r['step_s']:.2f} s "
                f"({r['ratio']:.2f}x); loop {r['loop_s']:.3f} s ({r['steady_ratio']:.3f}x)",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
