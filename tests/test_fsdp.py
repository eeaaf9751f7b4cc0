"""Sharpness of an FSDP2-sharded model equals the unsharded model's in one process.

``fsdp_worker.py`` runs as 2 and 4 gloo processes with torchrun's environment
(``tests/launch.py``; one thread each): a BERT and a LLaMA-style model (grouped-query
attention, rotary embeddings), in float64 and float32, measured unsharded and then
sharded with :func:`geosharp.fsdp.shard`, for adaptive, ``geodesic-inv``,
``geodesic-mix`` and Euclidean sharpness, worst case from zero and from a random start,
and average case. BERT's query/key/value biases are cut by heads, so each head's bias
row is held by one process (a zero phantom row on the other). The LLaMA also in bfloat16
(float32 perturbations on bfloat16 shards, attention-only and whole, its 50-row
embedding cut unevenly over 4 processes): the one-process value, and the float32 copy's
within the floor; on 2 processes also with its perturbed products in bfloat16 parts.
What needs no more than 2 processes runs on 2 only: a 4-process gloo collective on 2
cores costs about 5 times a 2-process one.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

from fsdp_worker import plan
from launch import run_python

ROOT = Path(__file__).resolve().parent.parent


def _benchmark(name: str):
    """The script ``benchmarks/{name}.py`` as a module (its helpers, not its ``main``),
    importing its sibling scripts as it does when run."""
    import sys

    spec = importlib.util.spec_from_file_location(name, ROOT / f"benchmarks/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    return module


WORKER = Path(__file__).resolve().parent / "fsdp_worker.py"
TOLERANCE = {"float64": 1e-8, "float32": 1e-4, "bfloat16": 1e-4}
RUNS = {
    2: [
        "bert-float64",
        "llama-float32",
        "llama-bfloat16",
        "checkpointed",
        "split",
        "sam:bert-float64",
        "errors",
    ],
    # what needs more than 2 processes: heads cut over more than 2, processes holding no
    # rows of a stack, an embedding cut unevenly; a collective costs 5x more here
    4: ["llama-float64", "llama-bfloat16", "split", "sam:llama-float64"],
}


@pytest.fixture(scope="session")
def runs(tmp_path_factory, request):
    """The workers' results, made once per test run: xdist's test processes share them
    through the run's temporary folder (the first makes them, the others wait)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if hasattr(request.config, "workerinput") else base
    with FileLock(str(shared / "fsdp.lock")):
        done = shared / "fsdp-results.json"
        if not done.exists():
            out = {}
            for nproc, names in RUNS.items():
                path = shared / f"fsdp{nproc}.json"
                run_python([str(WORKER), str(path), *names], nproc=nproc)
                out[nproc] = json.loads(path.read_text())
            done.write_text(json.dumps(out))
        return {int(k): v for k, v in json.loads(done.read_text()).items()}


@pytest.mark.parametrize("nproc", sorted(RUNS))
def test_a_sharded_model_gets_the_one_process_value_and_is_left_unchanged(runs, nproc):
    data = runs[nproc]
    assert data["world"] == nproc
    results = data["results"]
    for name in RUNS[nproc]:
        if name in ("errors", "checkpointed", "split") or name.startswith("sam:"):
            continue
        assert results[f"{name}/model unchanged"] is True
        # the control: a training step, whose FSDP gathers every layer in both passes
        assert min(results.pop(f"{name}/step gathers")) > 0
        units = results.pop(f"{name}/units")
        cases = {k: v for k, v in results.items() if k.startswith(name + "/") and "/model" not in k}
        assert set(cases) == {f"{name}/{m}/{c}" for m, c in plan(name)}
        tol = TOLERANCE[name.split("-")[1]]
        for key, case in cases.items():
            assert case["world"] == nproc, key
            # no head cut here: the pair states read their blocks from the shards where used
            assert (case["base reads"] > 0) == key.split("/")[1].startswith("geodesic"), key
            assert case["held"] == 0, key
            # a layer whose parameters are all perturbed is not gathered by FSDP, neither
            # for forward nor for backward (the measure computes on its own gathers);
            # attention-only keeps the MLP's, gathered in both
            for gathers in case["gathers"]:
                assert (gathers == 0) == ("attn" not in key), key
            # the measure's own collectives gather a layer's parameters at once (these
            # layers are under BUCKET entries): per forward one all-gather per layer (and
            # per module outside them), and in backward one all-gather again and one
            # reduce-scatter; one per parameter was 3-4 times as many
            own = case["collectives"]
            assert own["scatters"] <= units * own["forwards"], (key, own, units)
            assert (own["scatters"] > 0) == key.endswith(("/worst", "/worst-random")), key
            assert own["gathers"] <= 2 * units * own["forwards"], (key, own, units)
            # the set-up's check of reads outside the owners: one forward, FSDP gathering
            # every layer as for training
            assert case["checked"][0] > 0 and case["checked"][1] == 0, key
            assert case["loss"][0] == pytest.approx(case["loss"][1], rel=1e-12)
            for one, many in zip(case["one"], case["many"], strict=True):
                assert abs(many - one) <= tol * abs(one), (key, one, many)
            if "float32" in case:  # bfloat16 shards, float32 perturbations
                assert case["precision"] == "float32 in the perturbed modules, bfloat16 elsewhere"
                # a straight step's gradient kept in bfloat16 on the shards as in one process
                straight = "adaptive" in key
                assert case["gradient"] == ["bfloat16" if straight else "float32"] * 2, key
                value = sum(case["many"]) / len(case["many"])
                assert abs(value - case["float32"]) <= case["floor"], key
                assert abs(value - case["float32"]) <= 0.05 * case["float32"], key
                assert ("split" in case) == (nproc == 2), key
                if nproc == 2:
                    _split_as_in_one_process(key, case, value)


def _split_as_in_one_process(key, case, value):
    """The perturbed matrices' products in bfloat16 parts on the shards (split around
    the gathered point's own rounding) give the one-process split value (around the
    weight) and the float32 path's, within the floor; both records say so, both
    split, and the value is not the float32 path's (two computations)."""
    split = case["split"]
    assert all("products of the perturbed matrices in parts" in p for p in split["precision"])
    assert min(split["products"]) > 0, key
    assert split["floor"][0] == pytest.approx(case["floor"], rel=1e-6)
    assert abs(split["many"] - split["one"]) <= min(case["floor"], 0.02 * split["one"]), key
    assert abs(split["many"] - case["float32"]) <= min(case["floor"], 0.05 * case["float32"])
    assert split["many"] != value, key


@pytest.mark.parametrize("nproc", sorted(RUNS))
def test_heads_cut_across_processes_get_the_one_process_value(runs, nproc):
    """FSDP2's default plan (``Shard(0)``) with heads that do not divide over the
    processes: a 3-head BERT of 12 features (every head cut on 4 processes, the middle
    one on 2) and a LLaMA with one key/value head of 4 rows, float64 and bfloat16 (float32
    perturbations); each cut row is kept by one process and its entries moved through a
    buffer, the positions of those entries held as runs of their rows. Every case equals
    one process (also with every stack cut into runs of one head,
    :func:`~geosharp.geometry.stacked.max_stack`, on 4 processes for ``inv`` only; on 2
    processes, a LLaMA with two key/value heads has each such run on one process, the
    other holding none, and every run reads its blocks from the shards where used, none
    holding a copy, even a run of which one side lies wholly on the other process), with
    the pairs found before
    sharding, and the shards are unchanged afterwards. On 2 processes, pairs found on
    the sharded model's structure are checked on the sharded model (its attention units'
    weights all-gathered): all verified, and a query squashed by a forward hook, which
    the structure does not show, gets its pair refuted and dropped."""
    from fsdp_worker import SPLIT, runs_measures, split_plan

    results = runs[nproc]["results"]["split"]
    # the cut rows' positions (entries held here, places in the buffer and the blocks)
    # are held as runs of their rows, never as one int64 per entry
    compact, made = results["split positions as runs"]
    assert made > 0 and compact == made
    # and their pair states read their blocks where used, keeping the cut rows only
    holding, reading = results["cut stacks holding, reading their blocks"]
    assert holding == 0 and reading > 0
    for name in SPLIT:
        assert results[f"{name}/unchanged"] is True
        tol = TOLERANCE["bfloat16" if "bfloat16" in name else "float64"]
        for measure, case in split_plan(name, nproc):
            one, many = results[f"{name}/{measure}/{case}"]
            assert one != 0 and abs(many - one) <= tol * abs(one), (name, measure, case)
    runs_of = ["bert/runs"] + (["llama/runs", "llama/whole"] if nproc == 2 else [])
    for key in runs_of:  # runs: single heads
        for measure in runs_measures(nproc):
            one, many = results[f"{key}/{measure}"]
            assert one != 0 and abs(many - one) <= TOLERANCE["float64"] * abs(one), key
    if nproc == 2:
        # no row cut: every run's pair state reads its blocks from the shards
        assert results["llama/held"] == 0
        value, n_found, n_before, verified, unverified = results["bert/structure"]
        assert n_found == n_before == verified == 4 and unverified == []
        assert value == pytest.approx(results["bert/geodesic-inv/worst"][0], rel=1e-8)
        assert results["bert/refuted"] == [3, 3, []]  # the squashed query's pair dropped


def test_a_sharding_the_measure_cannot_use_is_a_one_line_error(runs):
    """A float32 model whose attention has a submodule gets the point written into its
    shards (not gathered) and its shards back. Attention written by hand (not a Hugging
    Face model) with its heads cut over the processes, passed no symmetries: pairs traced
    on its structure on the meta device and verified on the sharded model, the
    one-process value; a loss that needs values cannot be traced there, and the error
    says to find the pairs before sharding; a query weight tied across two layers (one
    FSDP group) leaves the second layer's pair unchecked, and the measure's one warning
    names it. Adaptive needs no pairs. bfloat16 shards: a tied embedding gets the
    one-process value, a loss that raises leaves the model as it was, a perturbed
    parameter of a module with submodules is refused. The same default plan on
    a 4-head BERT keeps whole rows and gets the one-process value, also with the pairs
    found on its structure (the same pairs as found on the unsharded model)."""
    messages = runs[2]["results"]["errors"]
    assert "found before sharding" in messages["no symmetries"]
    assert "does not run on the meta device (RuntimeError: " in messages["no symmetries"]
    one, many, n_before, n_found, verified = messages["hand-written"]
    assert n_before == n_found == verified == 4
    assert abs(many - one) <= 1e-8 * abs(one)
    # a weight tied across layers: the unit of the second layer's pairs holds FSDP
    # modules, so its pair is used unchecked, and the measure says so
    one, many, unverified, said = messages["tied"]
    assert abs(many - one) <= 1e-8 * abs(one) and unverified == ["blocks:value-output"]
    assert len(said) == 1, said
    assert "used without a numerical check on the model (blocks:value-output)" in said[0]
    # an owner that computes without gradient beside one that computes with it
    one, many = messages["no grad"]
    assert abs(many - one) <= 1e-8 * abs(one)
    one, many, restored = messages["written into the shards"]
    assert abs(many - one) <= 1e-8 * abs(one) and restored
    assert messages["adaptive needs no pairs"] > 0
    one, many = messages["default plan"]  # 4 heads on 2 processes: FSDP2's Shard(0)
    assert abs(many - one) <= 1e-8 * abs(one)
    inv_one, inv_many, mix_one, mix_many = messages["default plan, random"]
    assert abs(inv_many - inv_one) <= 1e-8 * abs(inv_one)
    assert abs(mix_many - mix_one) <= 1e-8 * abs(mix_one)
    found, n_pairs = messages["default plan, pairs from the structure"]
    assert n_pairs == messages["pairs found before sharding"]
    assert abs(found - one) <= 1e-8 * abs(one)
    one, many = messages["bfloat16 tied"]  # one slice gathered twice (embedding, head)
    assert abs(many - one) <= 1e-4 * abs(one)
    # the hooks removed and FSDP's flags restored; the shards and their flags kept
    hooks_and_flags, shards_kept, again = messages["bfloat16 after raising"]
    assert hooks_and_flags and shards_kept and again == many
    assert "has submodules" in messages["bfloat16 owner with submodules"]
    # an embedding's weight read by the model itself, for its output: float64 gets the
    # one-process value (the point written into the shards), bfloat16 a refusal
    elsewhere = messages["read elsewhere"]
    for part in ("whole", "embedding"):
        one, many, point = elsewhere[f"torch.float64/{part}"]
        assert abs(many - one) <= 1e-8 * abs(one), part
        assert point == "written into the shards", point  # the results say which path
        said = elsewhere[f"torch.bfloat16/{part}"]
        assert said.startswith("emb.weight is read outside the forward of the module"), said
    assert elsewhere["torch.float64/unchanged"] and elsewhere["torch.bfloat16/unchanged"]
    # the control: without the check, the head's read of the embedding stays unperturbed
    one = elsewhere["torch.float64/embedding"][0]
    unchecked, point = elsewhere["unchecked"]
    assert abs(unchecked - one) > 0.1 * abs(one) and point == "gathered"
    # where FSDP2's groups cannot be read: float64 written into the shards, bfloat16 said
    value, said, point = elsewhere["torch.float64/groups unread"]
    assert abs(value - one) <= 1e-8 * abs(one) and not any("parameter groups" in w for w in said)
    assert point == "written into the shards"
    _, said, point = elsewhere["torch.bfloat16/groups unread"]
    assert any("is not checked for" in w for w in said)
    assert point == "gathered, reads outside the owners not checked"
    assert "double backward" in messages["hessian"]
    assert "block_sharpness is not available on a sharded model" in messages["per"]


def test_a_plain_copy_computes_as_the_module_keeps_ties_and_the_users_hooks():
    """``plain_copy`` (the unit a check on a sharded model runs, and the structure traced
    on the meta device): the same output, a tied weight and a module under two names
    still one object, the user's hook kept and one that ``torch.distributed``
    registered dropped; the original untouched; on the meta device, the shapes."""
    import torch

    from geosharp.params import plain_copy

    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3)
    model = torch.nn.Sequential(lin, torch.nn.Tanh(), lin, torch.nn.Linear(3, 3))
    model[3].weight = lin.weight  # tied
    model[1].register_forward_hook(lambda m, args, y: 2 * y)  # the user's

    def gather(m, args):  # as FSDP's pre-forward would
        raise AssertionError("a torch.distributed hook ran on the copy")

    gather.__module__ = "torch.distributed.fsdp._fully_shard._fsdp_state"
    model[0].register_forward_pre_hook(gather)
    x = torch.randn(2, 3)
    copied = plain_copy(model, lambda t: t.detach().clone())
    with torch.no_grad():

        def linear(m, t):
            return torch.nn.functional.linear(t, m.weight, m.bias)

        expected = model[3](linear(lin, 2 * torch.tanh(linear(lin, x))))
        assert torch.equal(copied(x), expected)
    assert copied[0] is copied[2] and copied[3].weight is copied[0].weight
    assert copied[0].weight is not lin.weight and isinstance(copied[0].weight, torch.nn.Parameter)
    assert len(model[0]._forward_pre_hooks) == 1 and len(copied[0]._forward_pre_hooks) == 0
    assert len(copied[1]._forward_hooks) == 1
    meta = plain_copy(model, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))
    assert meta(x.to("meta")).shape == (2, 3) and lin.weight.device.type == "cpu"


def test_activation_checkpointing_is_kept_on_a_sharded_model(runs):
    """Hugging Face's activation checkpointing (non-reentrant) on the sharded LLaMA,
    bfloat16 and float32: kept during the measure, the one-process value; bfloat16's
    products in parts too (recomputed in backward through the split products), within
    2% of the one-process split (the two split around different roundings)."""
    cases = runs[2]["results"]["checkpointed"]
    assert set(cases) == {f"{d}/{m}" for d in ("bfloat16", "bfloat16 split", "float32")
                          for m in ("geodesic-inv-attn", "adaptive")}  # fmt: skip
    for key, (one, many, kept, *precision) in cases.items():
        assert kept is True, key
        assert (precision != []) == ("split" in key), key
        if precision:
            assert "products of the perturbed matrices in parts" in precision[0], key
            assert abs(many - one) <= 0.02 * abs(one), key
            assert many != cases[key.replace(" split", "")][1], key  # control
        else:
            assert abs(many - one) <= 1e-4 * abs(one), key


def test_the_docs_show_the_committed_benchmark_and_projection():
    """docs/performance.md's tables are ``benchmarks/projection.py``'s rendering of the
    committed benchmark output, and the README's ranges are read from it."""
    import sys

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        import projection
    finally:
        sys.path.pop(0)
    bench = json.loads((root / "docs/results/fsdp/bench_fsdp_mmap.json").read_text())
    assert bench["mmap_threshold"] and {r["processes"] for r in bench["rows"]} == {1, 2, 4}
    docs = (root / "docs/performance.md").read_text()
    assert projection.measured(bench) in docs and projection.table(bench) in docs
    readme = " ".join((root / "README.md").read_text().split())
    for kept in (False, True):
        values = [r["buffers_per_process"] for r in bench["rows"] if projection.kept(r) == kept]
        assert f"{min(values):.1f}-{max(values):.1f}" in readme
    ratios = [r["step_over_forward_backward"] for r in bench["rows"]]
    assert f"{min(ratios):.2f}-{max(ratios):.2f}x a forward+backward" in readme


def test_the_history_shows_the_committed_peak_profile():
    """benchmarks/HISTORY.md's account of the sharded measure's peak is the committed
    ``benchmarks/fsdp_peak.py`` output: without FSDP's gathers of fully perturbed
    layers, against FSDP gathering every layer; no positions or copies of the pair
    blocks held at the peak, under either plan."""
    root = Path(__file__).resolve().parent.parent
    results = root / "docs/results/fsdp"
    docs = " ".join((root / "benchmarks/HISTORY.md").read_text().split())
    runs = json.loads((results / "fsdp_peak.json").read_text())["runs"]
    now, every = runs["measure"], runs["measure, FSDP gathers every layer"]
    assert f"({now['peak']:.2f} of a shard against {every['peak']:.2f} with FSDP" in docs
    assert now["at"].startswith("backward") and not any(
        site.startswith("FSDP") for site, _ in now["alive"]
    )
    # no int64 positions of the pair blocks held (whole rows), no copy of the blocks of
    # the stacks whose rows are cut (FSDP2's default plan)
    for name, held in (
        ("fsdp_peak_h6_geodesic", ("geometry/sharded.py(391): localize",)),
        ("fsdp_peak_h6_geodesic_default", ("gather_params", "_split")),
    ):
        run = json.loads((results / f"{name}.json").read_text())["runs"]["measure"]
        assert not any(any(h in site for h in held) for site, _ in run["alive"])
        assert f"to {run['peak']:.2f} of a shard" in docs


def test_the_docs_show_the_committed_cut_heads_benchmark():
    """docs/performance.md's table of cut heads against whole rows is the committed
    output of ``bench_fsdp.py --plan default`` and ``--plan rows``."""
    root = Path(__file__).resolve().parent.parent
    docs = (root / "docs/performance.md").read_text()
    names = {"rows": "rows whole (`fsdp.shard`)", "default": "FSDP2's default, heads cut"}
    for kind, name in names.items():
        bench = json.loads((root / f"docs/results/fsdp/bench_fsdp_cut_{kind}.json").read_text())
        assert bench["plan"] == kind and bench["mmap_threshold"]
        for row in bench["rows"]:
            step = statistics.median(p["step"] for p in row["raw"])
            line = (
                f"| {name} | {row['measure']} | {row['buffers_per_process']:.2f} | "
                f"{row['step_over_forward_backward']:.2f} | {step:.2f} s |"
            )
            assert line in docs, line


@pytest.mark.parametrize("nproc", sorted(RUNS))
def test_geodesic_sam_on_a_sharded_model_takes_the_one_process_steps(runs, nproc):
    """Three GeodesicSAM steps (geodesic-inv, and adaptive: ASAM) on the sharded model
    leave the weights of the unsharded model trained in one process (FSDP averages the
    gradients over processes, which here see the same batches)."""
    name = next(n for n in RUNS[nproc] if n.startswith("sam:"))
    for measure, (worst, moved) in runs[nproc]["results"][name].items():
        assert moved > 1e-4, measure  # the steps moved the weights
        assert worst <= 1e-10, (measure, worst)


def test_the_history_shows_the_committed_memory_trace():
    """benchmarks/HISTORY.md's account of the 2-process count is that of the committed
    traces (``benchmarks/fsdp_memory_trace.py`` at 11 and 22 layers)."""
    docs = " ".join((ROOT / "benchmarks/HISTORY.md").read_text().split())
    traces = ROOT / "docs/results/llama_bf16/trace"
    found = {}
    for layers in (11, 22):
        rows = json.loads((traces / f"layers{layers}.json").read_text())
        assert {r["layers"] for r in rows} == {layers} and len(rows) == 4
        measure = [r for r in rows if r["mode"] == "geodesic-inv-attn"]
        step = [r for r in rows if r["mode"] == "step"]

        def at(name, rows=measure):
            return [mib for r in rows for n, mib in r["at_marks"] if n == name]

        held = [
            mib / r["vector_mib"]
            for r in measure
            for n, mib in r["at_marks"]
            if n.split()[0] in ("step", "evaluate") and int(n.split()[1]) >= 1
        ]
        assert all(r["new_tensors_left_mib"] == 0 for r in measure)
        found[layers] = dict(
            held=f"{min(held):.2f}-{max(held):.2f}",
            ends=f"{min(at('measure ends')):.0f}-{max(at('measure ends')):.0f}",
            trim=f"{max(at('after malloc_trim')):.0f}",
            step=f"{min(r['peak_mib'] for r in step):.0f}-{max(r['peak_mib'] for r in step):.0f}",
            heap=[
                (e - t) / r["vector_mib"]
                for r in measure
                for e, t in zip(at("measure ends", [r]), at("after malloc_trim", [r]))
            ],
        )
    short, deep = found[11], found[22]
    assert (
        f"holds {short['held']} vectors per process at 11 layers and {deep['held']} at 22" in docs
    )
    assert f"{short['ends']} MiB stay resident at 11 layers and {deep['ends']} MiB at 22" in docs
    assert f"`malloc_trim` (which hands free heap pages back), {short['trim']} and " in docs
    assert f"{deep['trim']} MiB, and no tensor made by the measure is left alive" in docs
    assert f"peak ({short['step']} and {deep['step']} MiB over the warmed-up model)" in docs
    heap = short["heap"] + deep["heap"]
    assert f"{min(heap):.2f}-{max(heap):.2f} vectors at the two depths" in docs


def test_the_docs_show_the_committed_bfloat16_benchmark():
    """docs/performance.md's tables of the 1.1B bfloat16 LLaMA are
    ``benchmarks/bench_llama_bf16.py --report`` of the committed output, and its GPU
    table ``benchmarks/bench_llama_gpu.py --report``'s; benchmarks/HISTORY.md's account
    of the runs is theirs."""
    root = Path(__file__).resolve().parent.parent
    bench = _benchmark("bench_llama_bf16")
    results = root / "docs/results/llama_bf16"
    runs = [
        json.loads((results / f"{n}.json").read_text())
        for n in ("bench", "bench_repeat1", "bench_repeat2")
    ]
    rows = bench.median_rows(runs)
    sharded, by_rows = (
        json.loads((results / f"{n}.json").read_text())
        for n in ("fsdp_default_mmap", "fsdp_rows_mmap")
    )
    for r in (*runs, sharded, by_rows):
        assert [x["mode"] for x in r] == ["step", "adaptive-attn", "geodesic-inv-attn"]
    assert all(x["processes"] == 2 for x in sharded + by_rows)
    assert {x["plan"] for x in sharded} == {"default"} and {x["plan"] for x in by_rows} == {"rows"}
    assert bench.report(rows, sharded=sharded) in (root / "docs/performance.md").read_text()
    kept, mmap = (
        json.loads((results / f"{n}.json").read_text())
        for n in ("bench_kept_gradient", "bench_mmap")
    )
    assert {x["restart"] for r in (*runs, mmap, sharded, by_rows) for x in r} == {"revisit"}
    assert {x["restart"] for x in kept} == {"kept gradient"}
    docs = " ".join((root / "benchmarks/HISTORY.md").read_text().split())

    def each(mode: int) -> str:
        values = [f"{run[mode]['buffers_beyond_step']:.2f}" for run in runs]
        return f"{', '.join(values[:-1])} and {values[-1]}"

    assert f"three runs: {each(1)} (adaptive), {each(2)} (geodesic-inv)" in docs
    assert (
        f"`bench_mmap.json`) {mmap[1]['buffers_beyond_step']:.2f} and "
        f"{mmap[2]['buffers_beyond_step']:.2f}" in docs
    )
    assert (
        f"(`bench_kept_gradient.json`, `--kept-gradient`) gave "
        f"{kept[1]['buffers_beyond_step']:.2f} and {kept[2]['buffers_beyond_step']:.2f}" in docs
    )
    assert {x.get("evaluations") for r in (*runs, mmap) for x in r[1:]} == {4}  # as the docs say
    assert (
        f"(sharded, `--mmap-threshold`): {sharded[1]['buffers_beyond_step']:.2f} and "
        f"{sharded[2]['buffers_beyond_step']:.2f} with FSDP2's default plan, "
        f"{by_rows[1]['buffers_beyond_step']:.2f} and {by_rows[2]['buffers_beyond_step']:.2f} "
        "with `geosharp.fsdp.shard`'s" in docs
    )
    assert (
        f"{sharded[1]['step_over_forward_backward']:.2f}x and "
        f"{sharded[2]['step_over_forward_backward']:.2f}x on 2 processes" in docs
    )
    gpu = root / "docs/results/gpu"
    gpu_rows = [
        r for n in ("gpu_1b", "gpu_7b") for r in json.loads((gpu / f"{n}.json").read_text())
    ]
    gpu_bench = _benchmark("bench_llama_gpu")
    assert gpu_bench.report(gpu_rows) in (root / "docs/performance.md").read_text()
    readme = " ".join((root / "README.md").read_text().split())
    adaptive, geodesic = rows[1], rows[2]  # the medians
    assert (
        f"took {adaptive['buffers_beyond_step']:.1f} (adaptive) and "
        f"{geodesic['buffers_beyond_step']:.1f} (geodesic `inv`) float32" in readme
    )
    assert (
        f"{adaptive['step_over_forward_backward']:.2f}x and "
        f"{geodesic['step_over_forward_backward']:.2f}x a forward+backward per step" in readme
    )


def test_the_docs_show_the_committed_step_profile():
    """docs/performance.md quotes the committed output of ``benchmarks/profile_step.py``
    and ``benchmarks/step_trend.py``."""
    root = Path(__file__).resolve().parent.parent
    log = (root / "docs/results/profile/step.log").read_text().strip()
    rows = json.loads((root / "docs/results/profile/step.json").read_text())
    assert [r["measure"] for r in rows] == ["adaptive", "geodesic-inv"]
    assert log in (root / "docs/performance.md").read_text()
    trend = (root / "docs/results/step_trend/trend.log").read_text().strip()
    rows = json.loads((root / "docs/results/step_trend/trend.json").read_text())
    assert trend in (root / "docs/performance.md").read_text()
    assert {(r["batch"], r["tokens"]) for r in rows} == {(2, 128), (8, 128), (16, 128)}


def test_the_gpu_benchmark_runs_dry_and_refuses_a_partial_measure(tmp_path):
    """``bench_llama_gpu.py`` measures a tiny LLaMA on the CPU (a dry run of its GPU
    path) and writes its rows; a measure that perturbed other entries than the
    attention's (pairs left unverified) is refused, not counted."""
    from types import SimpleNamespace

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "rows.json"
    run_python(
        [str(root / "benchmarks/bench_llama_gpu.py"), "--shape", "tiny", "--device", "cpu",
         "--tokens", "16", "--json", str(out)],
        nproc=1,
    )  # fmt: skip
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == [
        "step", "step-float32-attention", "adaptive-attn", "adaptive-attn (float32 products)",
        "geodesic-inv-attn", "geodesic-inv-attn (float32 products)",
    ]  # fmt: skip
    assert all(r["value"] > 0 for r in rows[2:]) and rows[4]["pairs"] == rows[5]["pairs"] == 4
    # the CPU keeps float32 products by default: the forced and default rows say the same
    assert "in parts" not in rows[2]["precision"] and rows[2]["precision"] == rows[3]["precision"]
    bench = _benchmark("bench_llama_bf16")
    partial = SimpleNamespace(settings={"n_perturbed": 10, "n_pairs": 1})
    bench.check_perturbed(SimpleNamespace(settings={"n_perturbed": 12, "n_pairs": 2}), 12)
    with pytest.raises(SystemExit, match="perturbed 10 entries, the attention has 12"):
        bench.check_perturbed(partial, 12)


def test_the_gpu_benchmarks_peak_breakdown_reads_the_allocations_live_at_the_peak():
    """``bench_llama_gpu.py --peaks`` groups what is allocated at the highest point of a
    CUDA allocator trace by the innermost geosharp frame: a block freed before the
    peak is not counted, one made after it neither."""
    gpu = _benchmark("bench_llama_gpu")

    def alloc(addr, size, where):
        frames = [{"filename": f"/x/torch/{where}", "line": 1, "name": "f"},
                  {"filename": f"/x/geosharp/{where}", "line": 2, "name": "g"}]  # fmt: skip
        return {"action": "alloc", "addr": addr, "size": size, "frames": frames}

    trace = [
        alloc(1, 8, "early.py"),
        {"action": "free_completed", "addr": 1},
        alloc(2, 4, "a.py"),
        alloc(3, 6, "b.py"),
        {"action": "free_completed", "addr": 3},
        alloc(4, 5, "late.py"),
    ]
    assert gpu.peak_breakdown(trace, 2) == [
        ["geosharp/b.py:2 g", 3.0], ["geosharp/a.py:2 g", 2.0], ["total", 5.0]
    ]  # fmt: skip
