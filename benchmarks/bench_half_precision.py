"""Memory of a bfloat16 model's measure: float32 only where the perturbation lives,
against float32 copies of the whole model.

    python benchmarks/bench_half_precision.py [--json out.json]

A LLaMA of 60M parameters (8 layers, width 512, vocabulary 32,000) in bfloat16,
attention-only adaptive sharpness (2 Auto-PGD steps, a batch of 2 x 64 tokens): the
growth of the peak resident size during the measure, each mode in a process of its own
(CPU, 2 threads). Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def one(mode: str) -> dict:
    import importlib
    import warnings

    import torch
    import transformers as tf

    import geosharp

    warnings.simplefilter("ignore")
    if mode == "whole-float32":  # the path geosharp takes where it cannot cast modules alone
        module = importlib.import_module("geosharp.measures.backends.owners")
        module.MixedPrecision.plan = classmethod(lambda cls, *args: None)
    torch.manual_seed(0)
    torch.set_num_threads(2)
    shape = dict(num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8)
    config = tf.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, **shape)
    model = tf.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 32000, (2, 64))
    attention = [n for n, _ in model.named_parameters() if ".self_attn." in n]

    def loss(m, batch):
        return m(input_ids=batch, labels=batch).loss.float()

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    estimator = geosharp.WorstCase(n_iters=2)
    result = geosharp.sharpness(
        model, [ids], loss, "adaptive", 0.05, estimator, parameters=attention
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sizes = dict(model.named_parameters())
    return {
        "mode": mode,
        "parameters": sum(p.numel() for p in model.parameters()),
        "perturbed": sum(sizes[n].numel() for n in attention),
        "peak_growth_mib": (peak - base) / 1024,
        "precision": result.settings["precision"],
        "value": result.value,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    rows = []
    for mode in ("mixed", "whole-float32"):
        out = subprocess.run([sys.executable, __file__, "--one", mode], check=True,
                             capture_output=True, text=True).stdout  # fmt: skip
        rows.append(json.loads(out.strip().splitlines()[-1]))
        r = rows[-1]
        sizes = f"{r['parameters'] / 1e6:.1f}M parameters, {r['perturbed'] / 1e6:.1f}M perturbed"
        grew = f"peak grew {r['peak_growth_mib']:.0f} MiB ({r['precision']})"
        print(f"{r['mode']:<14} {sizes}: {grew}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
