"""The Auto-PGD loop's own vector work, alone: the step's geometry with an objective that
only copies a fixed gradient (no forward, no backward), so that two versions of the core
compare without the forward+backward's noise.

    python benchmarks/loop_work.py --model bert
    PYTHONPATH=/path/to/old/checkout/src python benchmarks/loop_work.py --model bert

Models (random weights, the attention's pairs perturbed only, geodesic-inv): ``bert``,
BERT-base's shape in float32 (28M pair entries); ``llama-gqa``, a 6-layer LLaMA of
width 1024 with 16 query and 4 key/value heads in bfloat16 (16M). Prints the seconds per
step of each repeat (7 evaluations of 6 steps each, 2 CPU threads).

``--measure adaptive`` steps the same entries straight, on float32 tangents as a measure
does; ``--gradient model`` hands Auto-PGD a gradient in the model's dtype (a bfloat16
model's: kept apart, the iterate held as its point) instead of float32 (written over
the point):

    python benchmarks/loop_work.py --model llama-gqa --measure adaptive --gradient model
"""

from __future__ import annotations

import argparse
import json
import time


def _model(name: str):
    import torch
    import transformers as tf

    if name == "bert":
        config = tf.BertConfig(num_labels=2, attn_implementation="eager")
        return tf.BertForSequenceClassification(config).eval()
    config = tf.LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
        num_attention_heads=16, num_key_value_heads=4, vocab_size=1000,
    )  # fmt: skip
    return tf.LlamaForCausalLM(config).to(torch.bfloat16).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["bert", "llama-gqa"], default="bert")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--measure", choices=["geodesic-inv", "adaptive"], default="geodesic-inv")
    parser.add_argument("--gradient", choices=["float32", "model"], default="float32")
    args = parser.parse_args()

    import torch

    import geosharp
    from geosharp.geometry import Geometry, PerturbationSpace
    from geosharp.layout import ParameterLayout
    from geosharp.measures.apgd import auto_pgd

    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = _model(args.model)
    batch = {"input_ids": torch.randint(0, 1000, (1, 16))}
    pairs = geosharp.find_symmetries(model, batch).pairs
    names = {b.param for s in pairs for b in (*s.g_blocks, *s.h_blocks)}
    named = [(n, p.detach()) for n, p in model.named_parameters() if n in names]
    layout = ParameterLayout.from_named(named)
    if args.measure == "adaptive":
        geometry, pairs, dtype = Geometry.named("adaptive"), [], torch.float32
    else:  # as before the option: tangents in the model's dtype
        geometry, dtype = Geometry.named("geodesic", "inv"), None
    space = PerturbationSpace(dict(named), layout, pairs, geometry, dtype=dtype)
    grad = torch.randn(layout.numel) * 1e-3
    width = named[0][1].dtype if args.gradient == "model" else torch.float32

    def loss_grad(point, out):
        return point[:8].sum(), out.copy_(grad)

    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        auto_pgd(loss_grad, space, 0.1, 6, grad_dtype=width)
        seconds.append((time.perf_counter() - start) / 7)
    print(
        f"{args.model}, {args.measure}, gradient {args.gradient}: "
        f"{layout.numel / 1e6:.1f}M pair entries, seconds per step "
        + " ".join(f"{s:.3f}" for s in seconds)
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"model": args.model, "measure": args.measure, "gradient": args.gradient,
                 "numel": layout.numel, "seconds": seconds},
                f,
            )  # fmt: skip


if __name__ == "__main__":
    main()
