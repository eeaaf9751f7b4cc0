"""The coverage table: 75 Hugging Face architecture families (``tests/hf_zoo.py``).

Each family is built tiny from its config (float64, random biases) and traced on one
batch. In every attention module, discovery must find the family's pairs (kind, group,
columns), or drop exactly the pairs that are not symmetries, with the reason; every pair
must pass its numerical check, conclusively; a random transform of all pairs must keep
the logits (1e-8 relative, or the family's documented tolerance); and geodesic
sharpness (``inv`` and ``mix``) must not move under it, while adaptive sharpness does.
``docs/architectures.md`` holds the table these expectations render to.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import geosharp
from geosharp.symmetry import find_symmetries, random_transforms, transform_parameters
from hf_zoo import BY_NAME, FAMILIES, LABELLED, build, logits_of, render_table

pytest.importorskip("transformers")

RHO = {"geodesic-inv": 0.1, "geodesic-mix": 0.01, "adaptive": 0.1}
GEODESIC_TOL = 1e-6  # relative change of geodesic sharpness under a symmetry transform
FLOAT32_TOL = 1e-4  # ... where transformers computes part of the attention in float32
ADAPTIVE_MIN = 1e-3  # relative change adaptive sharpness must show


@contextlib.contextmanager
def _dtype(name: str):
    """XGLM builds ``torch.full((), finfo(float64).min)`` in the default dtype: a
    float64 model needs a float64 default (a transformers bug)."""
    if name != "xglm":
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@pytest.fixture(scope="module", params=[f.name for f in FAMILIES])
def traced(request):
    """A family's model, batch, loss and symmetries (found once for both tests)."""
    family = BY_NAME[request.param]
    with _dtype(family.name):
        model, inputs, loss = build(family)
        symmetries = find_symmetries(model, inputs, warn=False)
    return family, model, inputs, loss, symmetries


def test_discovery_matches_the_table(traced):
    family, _, _, _, sym = traced
    assert sym.discovery == "trace"
    assert sym.unrecognized == [], sym.summary()
    assert sym.attention, "no attention module found"
    for module in sym.attention:
        found = tuple((p.kind, p.group, p.shape[3]) for p in sym.pairs if p.module == module)
        if family.shared and not found:  # a call of a shared block: its pairs are the first's
            continue
        assert found == family.pairs, (module, found)
        drops = [d for d in sym.dropped if d.module == module]
        assert [d.kind for d in drops] == [kind for kind, _ in family.drops], (module, drops)
        for d, (_, words) in zip(drops, family.drops):
            assert d.exact and words in d.reason, d
    for pair in sym.pairs:
        check = sym.verified[pair.name]
        assert check.ok and check.conclusive, check


def test_transform_keeps_logits_and_geodesic_sharpness(traced):
    family, model, inputs, loss, sym = traced
    estimator = geosharp.WorstCase(n_iters=2)
    if not sym.pairs:  # no symmetry at all: the geodesic measure is adaptive, and says why
        kw = dict(estimator=estimator, symmetries=sym)
        geodesic = geosharp.sharpness(model, [inputs], loss, "geodesic-inv", 0.1, **kw)
        adaptive = geosharp.sharpness(model, [inputs], loss, "adaptive", 0.1, **kw)
        assert geodesic.value == adaptive.value and geodesic.symmetry_complete
        assert geodesic.symmetry["absent"] and not geodesic.symmetry["ignored"]
        return
    transforms = random_transforms(sym, cond=10.0, seed=1)
    params = {n: p.detach() for n, p in model.named_parameters()}
    moved = transform_parameters(params, sym.pairs, transforms)
    with _dtype(family.name), torch.no_grad():
        reference = logits_of(model(**inputs))
        after = logits_of(torch.func.functional_call(model, moved, (), inputs))
    change = float((after - reference).abs().max() / reference.abs().max())
    assert change < family.tolerance, (change, family.why)

    twin = copy.deepcopy(model)
    geosharp.reparameterize(twin, sym, transforms=transforms)

    def value(m, measure):
        with _dtype(family.name):
            return geosharp.sharpness(
                m, [inputs], loss, measure, RHO[measure], estimator, symmetries=sym
            ).value

    tolerance = FLOAT32_TOL if family.why else GEODESIC_TOL
    for measure in ("geodesic-inv", "geodesic-mix"):
        before, after = value(model, measure), value(twin, measure)
        assert before > 0
        assert abs(after - before) <= tolerance * abs(before), (measure, before, after)
    before, after = value(model, "adaptive"), value(twin, "adaptive")
    assert abs(after - before) > ADAPTIVE_MIN * abs(before), (before, after)


@pytest.mark.parametrize("family", LABELLED, ids=[f.name for f in LABELLED])
def test_families_understood_in_part_say_what_is_not(family):
    """Every pair found is verified; what is not understood is said, with its reason."""
    model, inputs, _ = build(family)
    sym = find_symmetries(model, inputs, warn=False)
    module = sym.attention[0]
    found = tuple((p.kind, p.group, p.shape[3]) for p in sym.pairs if p.module == module)
    assert found == family.pairs and all(c.ok and c.conclusive for c in sym.verified.values())
    drops = [d for d in sym.dropped if d.module == module]
    assert [(d.kind, d.exact) for d in drops] == [(k, False) for k, _ in family.drops]
    assert all(words in d.reason for d, (_, words) in zip(drops, family.drops))
    assert not sym.complete and module in sym.unrecognized


def test_docs_table_is_the_families_table():
    """``docs/architectures.md`` shows this table, rendered from ``tests/hf_zoo.py``
    (regenerate with ``python tests/hf_zoo.py``)."""
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / "architectures.md").read_text()
    assert render_table() in text


def test_docs_example_runs_as_written(capsys):
    """The example of declaring pairs in ``docs/architectures.md`` runs as written."""
    import re
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / "architectures.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", text, re.S)
    exec(compile(block, "docs/architectures.md", "exec"), {"__name__": "__docs__"})
    assert "query-key" in capsys.readouterr().out


def test_readme_counts_are_the_tables():
    """The README's coverage counts are those of the family table."""
    import re
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    both = [f for f in FAMILIES if not f.drops]
    partial = [f for f in FAMILIES if f.drops]
    counts = dict(re.findall(r"^\| ([^|]+?) \| (\d+) \|$", readme, re.M))
    assert int(counts["Hugging Face families built tiny from their configs"]) == len(FAMILIES)
    assert int(counts["symmetry-correct: every attention module understood and verified"]) == (
        len(FAMILIES)
    )
    assert int(counts["... with both pairs of every head"]) == len(both)
    (label,) = [k for k in counts if k.startswith("... with the pairs that are not")]
    assert int(counts[label]) == len(partial)
    named = {"Qwen3": "qwen3", "OLMo2": "olmo2", "Gemma3": "gemma3",
             "OLMo `clip_qkv`": "olmo-clip-qkv"}  # fmt: skip
    assert {named[n.strip()] for n in label.split("(")[1].rstrip(")").split(",")} == {
        f.name for f in partial
    }


def test_docs_numbers_are_the_benchmarks():
    """The measured numbers of ``docs/architectures.md`` and ``docs/symmetries.md`` are those of
    ``docs/results/discovery/bench.json`` (``python benchmarks/bench_discovery.py``)."""
    import json
    import re
    from pathlib import Path

    root = Path(__file__).parent.parent
    bench = json.loads((root / "docs/results/discovery/bench.json").read_text())
    rows = bench["families"]
    docs = (root / "docs/architectures.md").read_text()
    summary = (root / "docs/symmetries.md").read_text()
    assert len(rows) == len(FAMILIES) and all(r["not_understood"] == 0 for r in rows)
    f64 = max(r["worst_check"] or 0 for r in rows if not BY_NAME[r["family"]].why)
    f32 = max(r["worst_check"] or 0 for r in rows if BY_NAME[r["family"]].why)
    power = min(r["least_power"] for r in rows if r["least_power"] is not None)
    median = sorted(r["verification_seconds"] for r in rows)[len(rows) // 2]
    sentence = " ".join(docs.split("Measured (")[1].split(". ")[0:2]).replace("\n", " ")
    assert f"was {f64:.1e} (relative" in sentence and f"{f32:.1e} where" in sentence
    text = docs.replace("\n", " ")
    assert f"was {power:.2f}, and every check was conclusive" in text
    assert f"{1e3 * median:.1f} ms of verification per model" in docs
    meta = bench["meta_70b"]
    claim = f"{meta['pair_blocks']} pair blocks"
    seconds = f"{min(meta['seconds']):.1f} s"
    assert f"{claim}, {meta['pairs']:,} key/value-head" in docs and f"in {seconds}" in docs
    assert re.search(rf"{claim} in {re.escape(seconds)}", summary)
