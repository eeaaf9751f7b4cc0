"""``geosharp demo``: the built-in default job, offline, about a minute on 2 CPU cores.

1. Train a tiny Hugging Face ViT (2 layers, 4 heads of 8) on scikit-learn's digits.
2. Measure Euclidean, adaptive and geodesic (``inv`` and ``mix``) worst-case sharpness
   on 1024 training points (4 batches of 256, averaged per batch as in the paper).
   Its symmetric pairs are found from what it computes on a training batch, each
   one verified numerically.
3. Re-parameterise the model by a random symmetry: every query/key and value/output
   pair ``(G, H) -> (G A, H A^{-T})`` with condition number ``cond``. The network
   computes the same function (the output change is printed).
4. Measure again and print which numbers moved.
5. Show the same discovery on other architectures, built from their configs on the
   ``meta`` device (no weights): the group it finds, and what it leaves out and why.
"""

from __future__ import annotations

import copy
import time

import torch

from ..errors import require_all
from ..io import write_json_atomic
from ..loading.data import load_digits
from ..measures import DEFAULT_RHO, WorstCase, sharpness
from ..models.vit import (
    accuracy_and_loss,
    image_batches,
    image_loss,
    tiny_vit,
    train_image_classifier,
)
from ..symmetry import check_symmetries, find_symmetries, reparameterize

__all__ = ["DEMO_MEASURES", "run_demo"]

# (label, measure name): each at its default radius (DEFAULT_RHO); radii of different
# geometries mean different things (MATH.md section 2).
DEMO_MEASURES = (
    ("euclidean", "euclidean"),
    ("adaptive", "adaptive"),
    ("geodesic inv", "geodesic-inv"),
    ("geodesic mix", "geodesic-mix"),
)


def run_demo(
    seed: int = 0,
    n_iters: int = 20,
    cond: float = 100.0,
    json_path: str | None = None,
    epochs: int = 40,
    print_fn=print,
) -> int:
    """The steps of the module's docstring, each printed; ``json_path``: the figures."""
    # before anything slow
    require_all(
        ("transformers", "sklearn"), "the demo (a Hugging Face ViT on scikit-learn's digits)"
    )
    start = time.perf_counter()
    model, train, figures = _train(seed, epochs, start, print_fn)
    probe = train.images[:64]
    figures["symmetry_check"] = _discover(model, probe, print_fn)
    twin, figures["output_change"] = _reparameterized(model, probe, cond, seed, print_fn)
    batches = list(image_batches(train.images[:1024], train.labels[:1024], 256))
    rows = [_measure_both(model, twin, batches, label, name, n_iters, seed)
            for label, name in DEMO_MEASURES]  # fmt: skip
    _print_table(rows, print_fn)
    coverage = _coverage(print_fn)
    print_fn(f"total time {time.perf_counter() - start:.1f}s")
    if json_path:
        payload = dict(seed=seed, n_iters=n_iters, cond=cond, **figures)
        write_json_atomic(json_path, dict(payload, measures=rows, coverage=coverage))
    return 0


def _train(seed: int, epochs: int, start: float, print_fn):
    """The tiny ViT trained on the digits' training split; its accuracies and losses."""
    data = load_digits()
    train, test = data.split(1500, seed=seed)
    print_fn(
        f"geosharp demo: tiny ViT on scikit-learn digits ({len(train.labels)} train, "
        f"{len(test.labels)} test), seed {seed}"
    )
    model = tiny_vit(seed=seed)
    train_image_classifier(
        model, train.images, train.labels, epochs=epochs, seed=seed, progress=True
    )
    train_acc, train_loss = accuracy_and_loss(model, train.images, train.labels)
    test_acc, test_loss = accuracy_and_loss(model, test.images, test.labels)
    print_fn(
        f"trained in {time.perf_counter() - start:.1f}s: train accuracy {train_acc:.3f}, "
        f"test accuracy {test_acc:.3f}"
    )
    figures = dict(
        train_accuracy=train_acc, test_accuracy=test_acc, train_loss=train_loss,
        test_loss=test_loss,
    )  # fmt: skip
    return model, train, figures


def _discover(model, probe, print_fn) -> float:
    """The pairs found from what the model computes, verified; the check's largest
    relative change."""
    symmetries = find_symmetries(model, probe)
    n_pairs = sum(p.shape[0] for p in symmetries.pairs)
    worst = max(v.change for v in symmetries.verified.values())
    check = check_symmetries(model, probe, symmetries)
    print_fn(
        f"found {n_pairs} GL(8) pairs in {len(symmetries.attention)} attention modules from what "
        f"the model computes, each verified (largest output change {worst:.0e}); {check}"
    )
    return check.max_rel_change


def _reparameterized(model, probe, cond: float, seed: int, print_fn):
    """A copy moved by random symmetries of condition number ``cond``, and how much its
    logits changed."""
    twin = copy.deepcopy(model)
    reparameterize(twin, find_symmetries(twin), cond=cond, seed=seed + 1)
    with torch.no_grad():
        before = model(pixel_values=probe).logits
        after = twin(pixel_values=probe).logits
        output_change = float((after - before).abs().max())
        weight_change = max(
            float((a - b).abs().max() / b.abs().max())
            for a, b in zip(twin.parameters(), model.parameters())
        )
    print_fn(
        f"re-parameterised by random symmetries (condition number {cond:g}): weights "
        f"changed by up to {weight_change:.0%}, logits by {output_change:.1e}"
    )
    return twin, output_change


def _measure_both(model, twin, batches, label: str, name: str, n_iters: int, seed: int):
    """One measure of the model and of its re-parameterised copy, at its default rho."""
    rho = DEFAULT_RHO[name]
    values = [
        sharpness(
            net, batches, image_loss, measure=name, rho=rho,
            estimator=WorstCase(n_iters=n_iters), seed=seed, progress=True,
        ).value
        for net in (model, twin)
    ]  # fmt: skip
    change = abs(values[1] - values[0]) / max(abs(values[0]), 1e-12)
    return dict(
        measure=label, rho=rho, original=values[0], reparameterised=values[1],
        relative_change=change,
    )  # fmt: skip


def _print_table(rows: list[dict], print_fn) -> None:
    print_fn("")
    print_fn(
        f"{'measure':<14} {'rho':>6} {'original':>10} {'re-param.':>10} {'change':>9}  invariant?"
    )
    for r in rows:
        verdict = "yes" if r["relative_change"] < 0.01 else "NO - moved by the symmetry"
        print_fn(
            f"{r['measure']:<14} {r['rho']:>6g} {r['original']:>10.4g} "
            f"{r['reparameterised']:>10.4g} {_percent(r['relative_change']):>9}  {verdict}"
        )
    print_fn("")
    print_fn(
        "Both networks compute the same function; only the geodesic measures, which live "
        "on the quotient\nby the attention symmetries, give them the same sharpness. "
        "Sharpness values of different\ngeometries are not comparable at one rho "
        "(see docs/rho.md)."
    )


# Other architectures for the coverage lines: (label, config class, model class, config).
_TINY = dict(vocab_size=100, num_hidden_layers=1, num_attention_heads=4)
COVERAGE_DEMO = (
    ("GPT-2 (fused Conv1D)", "GPT2Config", "GPT2Model",
     dict(vocab_size=100, n_embd=64, n_layer=1, n_head=4)),
    ("LLaMA (rotary, grouped-query)", "LlamaConfig", "LlamaModel",
     dict(_TINY, hidden_size=64, intermediate_size=128, num_key_value_heads=2)),
    ("GPT-NeoX (fused, partial rotary)", "GPTNeoXConfig", "GPTNeoXModel",
     dict(_TINY, hidden_size=64, intermediate_size=128, rotary_pct=0.25)),
    ("BLOOM (fused, ALiBi)", "BloomConfig", "BloomModel",
     dict(vocab_size=100, hidden_size=64, n_layer=1, n_head=4)),
    ("T5 (relative bias, cross-attention)", "T5Config", "T5Model",
     dict(vocab_size=100, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4)),
    ("Qwen3 (normalised queries, keys)", "Qwen3Config", "Qwen3Model",
     dict(_TINY, hidden_size=64, intermediate_size=128, num_key_value_heads=2, head_dim=16)),
)  # fmt: skip


def _coverage(print_fn) -> list[dict]:
    """Discovery on :data:`COVERAGE_DEMO`, each built on the meta device: one line each,
    the groups of its first attention module and the pairs dropped there, with why."""
    try:
        import transformers
    except ImportError:  # the hf extra: nothing to show
        return []
    from ..loading.hf import quiet_transformers

    print_fn("")
    print_fn(
        "The same discovery, on models built from their configs on the meta device (no "
        "weights;\nsee docs/architectures.md for 74 families):"
    )
    out = []
    for label, config_name, model_name, settings in COVERAGE_DEMO:
        with quiet_transformers():  # the tiny vocabularies' notes on special tokens
            config = getattr(transformers, config_name)(**settings)
            with torch.device("meta"):
                model = getattr(transformers, model_name)(config)
        found = find_symmetries(model, warn=False)
        first = found.attention[0]
        groups = [f"{p.kind} {p.group_label}" for p in found.pairs if p.module == first]
        dropped = [f"{d.kind} dropped: {d.reason}" for d in found.dropped if d.module == first]
        text = "; ".join(groups + dropped)
        print_fn(f"  {label:<36} {text}")
        out.append(dict(model=label, pairs=groups, dropped=dropped))
    print_fn(
        "A module whose symmetry geosharp does not understand is never measured silently: "
        "the result\nand the CLI table say so, and strict=True / --strict refuses."
    )
    return out


def _percent(x: float) -> str:
    """A relative change as a percentage, in scientific notation below 0.01%."""
    return f"{x:.2%}" if x >= 1e-4 or x == 0 else f"{100 * x:.0e}%"
