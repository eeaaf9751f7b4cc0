"""The share of a measure's matrix-product FLOPs that run in float32, on a bfloat16
LLaMA: counted, not timed (a structural figure, the same on any machine).

    python benchmarks/flop_share.py [--tokens 128] [--batch 2] [--json out.json]

Every matrix product the measure dispatches (``mm``, ``addmm``, ``bmm``, ``baddbmm``,
convolutions, attention kernels: torch's own FLOP formulas) is counted under the dtype
its operands multiply in. Rows: a bfloat16 forward+backward (the training step), and
``adaptive-attn``, ``geodesic-inv-attn`` and ``adaptive`` (3 Auto-PGD steps each),
each with the perturbed layers' products split into bfloat16 parts (``split.ENABLED =
True``; the default on a GPU) and in float32 (``False``; as before, and the CPU's
default). The float64 column: in a measure that finds its pairs, their verification
(once, before the search); in the last row, 20 steps of ``geodesic-inv-attn`` given
the pairs, the pair states' ``h x h`` algebra alone. The model: 2 layers of width 256,
8 query and 2 key/value heads, vocabulary 512, random weights of std 0.05 (at 0.02
the query-key pairs barely move the output and are left out, unverified).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

_BIASED = {torch.ops.aten.addmm, torch.ops.aten.baddbmm}  # the first operand is added


class MatmulFlops(TorchDispatchMode):
    """Inside, ``flops[dtype]`` adds up the FLOPs of every matrix product, by the dtype
    of its (first multiplied) operand."""

    def __init__(self):
        super().__init__()
        self.flops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in flop_registry:
            operands = [a for a in args if isinstance(a, torch.Tensor)]
            operand = operands[1] if packet in _BIASED else operands[0]
            self.flops[operand.dtype] += flop_registry[packet](*args, **kwargs, out_val=out)
        return out

    def share(self, dtype=torch.float32) -> float:
        total = sum(self.flops.values())
        return self.flops[dtype] / total if total else 0.0


def model_and_batch(tokens: int = 128, batch: int = 2, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=2, max_position_embeddings=2 * tokens,
                         attn_implementation="eager")  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (batch, tokens), generator=g)
    return model, {"input_ids": ids, "labels": ids}


def loss(model, batch):
    """The next-token loss in float32 from the bfloat16 logits."""
    logits = model(input_ids=batch["input_ids"]).logits.float()
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten()
    )


def count(
    model, batch, measure: str | None, split: bool = True, n_iters: int = 3, symmetries=None
) -> MatmulFlops:
    """The FLOPs of one ``measure`` (``None``: a forward+backward) by dtype; given
    ``symmetries``, the measure's own set-up and search without finding pairs."""
    import warnings

    import geosharp
    from geosharp.measures.backends import split as products

    was, products.ENABLED = products.ENABLED, bool(split)
    try:
        with MatmulFlops() as counter, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the floor's: these weights are random
            if measure is None:
                loss(model, batch).backward()
                model.zero_grad(set_to_none=True)
            else:
                geosharp.sharpness(model, [batch], loss, measure, rho=0.5, symmetries=symmetries,
                                   estimator=geosharp.WorstCase(n_iters=n_iters))  # fmt: skip
    finally:
        products.ENABLED = was
    return counter


ROWS = [("step", None, True)] + [
    (f"{m} ({'split' if s else 'float32'} products)", m, s)
    for m in ("adaptive-attn", "geodesic-inv-attn", "adaptive")
    for s in (True, False)
]


def main(argv=None) -> None:
    import geosharp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    model, batch = model_and_batch(args.tokens, args.batch)
    counted = {name: count(model, batch, measure, split) for name, measure, split in ROWS}
    given = geosharp.find_symmetries(model, batch, loss_fn=loss)
    counted["geodesic-inv-attn (split, pairs given, 20 steps)"] = count(
        model, batch, "geodesic-inv-attn", n_iters=20, symmetries=given
    )
    out = {}
    for name, counter in counted.items():
        out[name] = {str(k).removeprefix("torch."): v for k, v in counter.flops.items()}
        print(f"{name:48s} float32 {counter.share():6.1%}  "
              f"float64 {counter.share(torch.float64):6.2%}  "
              f"total {sum(counter.flops.values()) / 1e9:7.3f} GFLOP", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
