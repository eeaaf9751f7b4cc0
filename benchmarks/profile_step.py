"""Where an Auto-PGD step's time goes beyond its forward+backward: the step's work
method by method, against the forward+backward it wraps.

    python benchmarks/profile_step.py [--json out.json] [--tokens 128] [--batch 2]

A BERT-base-shaped encoder (12 layers, width 768, 12 heads; random weights, float32) on
one batch of ``--batch`` x ``--tokens`` random tokens, 2 CPU threads; for adaptive and
``geodesic-inv`` sharpness of the whole model, 6 Auto-PGD steps under ``cProfile``. The
forward+backward is the time inside the loss-and-gradient call; each method of the
perturbation space (``retr_``, ``pullback_``, ``proju_``, ``direction_``, ...) is
reported by its cumulative time per step, with the share of the pair blocks in it, and
"rest" is what is left of the step. Times are under the profiler, which slows the
Python-level calls. Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats

METHODS = {  # method -> the file that defines it: the space's, the Auto-PGD kernel's
    "retr_": "space.py", "pullback_": "space.py", "proju_": "space.py",
    "inner": "space.py", "norm": "space.py", "empty": "space.py",
    "direction_": "apgd_step.py", "combine_": "apgd_step.py",
    "scale_": "elementwise.py", "clamp_box_": "elementwise.py",
}  # fmt: skip


PAIR_METHOD: dict[str, str] = {}  # the pair factor's part, where named apart


def profile(measure: str, batch: int, tokens: int, n_iters: int = 6) -> dict:
    import warnings

    import torch
    import transformers as tf

    import geosharp

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    torch.set_num_threads(2)
    config = tf.BertConfig(num_labels=2, attn_implementation="eager")
    model = tf.BertForSequenceClassification(config).eval()
    ids = torch.randint(0, config.vocab_size, (batch, tokens))
    data = [{"input_ids": ids, "labels": torch.zeros(batch, dtype=torch.long)}]

    def loss(m, b):
        return m(**b).loss

    symmetries = geosharp.find_symmetries(model, data[0], loss_fn=loss)
    steps = []

    def callback(event, i, iterate):
        if event == "step":
            steps.append(i)

    profiler = cProfile.Profile()
    profiler.enable()
    geosharp.sharpness(
        model, data, loss, measure, None, geosharp.WorstCase(n_iters),
        symmetries=symmetries, callback=callback,
    )  # fmt: skip
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    n_steps = max(len(steps), 1)

    def cumulative(module: str, name: str) -> float:
        return sum(v[3] for (path, _, func), v in stats.items() if func == name and module in path)

    total = cumulative("estimators.py", "estimate")
    forward_backward = cumulative("loss_grad.py", "__call__")  # LossGrad: n_iters + 1 calls
    calls = n_iters + 1
    row = {
        "measure": measure,
        "batch": batch,
        "tokens": tokens,
        "steps": n_steps,
        "forward_backward_s": forward_backward / calls,
        "step_s": total / calls,
    }
    # the space's and the kernel's methods, and the pair blocks' share of each
    # (geometry/stacked.py, called from them)
    row["methods_s"] = {
        m: cumulative(f, m) / n_steps for m, f in METHODS.items() if cumulative(f, m)
    }
    row["pairs_s"] = {
        m: cumulative("stacked.py", PAIR_METHOD.get(m, m)) / n_steps
        for m in METHODS
        if cumulative("stacked.py", PAIR_METHOD.get(m, m))
    }
    row["rest_s"] = row["step_s"] - row["forward_backward_s"] - sum(row["methods_s"].values())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    rows = [profile(m, args.batch, args.tokens) for m in ("adaptive", "geodesic-inv")]
    for r in rows:
        ratio = r["step_s"] / r["forward_backward_s"]
        print(
            f"{r['measure']}: a step {r['step_s']:.3f} s, its forward+backward "
            f"{r['forward_backward_s']:.3f} s ({ratio:.2f}x); per step:"
        )
        for name, seconds in sorted(r["methods_s"].items(), key=lambda kv: -kv[1]):
            pairs = r["pairs_s"].get(name, 0.0)
            print(
                f"  {name:<18} {seconds:.4f} s  ({seconds / r['forward_backward_s']:.1%} of the "
                f"forward+backward; pair blocks {pairs:.4f} s)"
            )
        print(f"  {'rest':<18} {r['rest_s']:.4f} s  (the loop's own vector work, the callback)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
