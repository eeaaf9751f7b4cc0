"""What one Auto-PGD step of a sharded measure sends between processes: the number of
all-reduces per step, of scalars and of stacked ``h x h`` matrices, per measure.

    torchrun --nproc_per_node=2 benchmarks/fsdp_reductions.py

(gloo on the CPU, a small BERT; the counts depend on the number of pair stacks, not on
the model's size). Rank 0 prints one JSON line per measure: all-reduces per step,
split into scalars and ``(B, h, h)`` stacks per pair stack.
"""

from __future__ import annotations

import itertools
import json

import torch
import torch.distributed as dist
from transformers import BertConfig, BertForSequenceClassification

import geosharp
from geosharp import distributed as gd
from geosharp import fsdp

MEASURES = {"adaptive": 0.05, "geodesic-inv": 0.05, "geodesic-mix": 0.01}


def main() -> None:
    torch.set_num_threads(1)
    rank, _ = gd.init()
    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=16, attn_implementation="eager")  # fmt: skip
    model = BertForSequenceClassification(config)
    batch = {"input_ids": torch.randint(0, 64, (4, 8)), "labels": torch.tensor([0, 1, 0, 1])}

    def loss_fn(m, b):
        return m(**b).loss

    fsdp.shard(model, geosharp.find_symmetries(model, batch, loss_fn=loss_fn))
    calls: list[int] = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    for measure, rho in MEASURES.items():
        marks: list[int] = []

        def callback(event, i, x, marks=marks):
            if event == "step":
                marks.append(len(calls))

        dist.all_reduce = counting
        try:
            estimator = geosharp.WorstCase(n_iters=12)
            geosharp.sharpness(model, [batch], loss_fn, measure, rho, estimator, callback=callback)
        finally:
            dist.all_reduce = original
        # the calls between two steps: one step's update, retraction, pullback and loss
        # (the fewest: a step whose search evaluates no point again)
        gaps = [calls[a:b] for a, b in itertools.pairwise(marks)]
        step = min(gaps, key=len)
        scalars = sum(1 for n in step if n == 1)
        if rank == 0:
            print(json.dumps({"measure": measure, "all_reduces": len(step),
                              "scalars": scalars, "stacked_hxh": len(step) - scalars}))  # fmt: skip
        calls.clear()
    del model
    gd.close()


if __name__ == "__main__":
    main()
