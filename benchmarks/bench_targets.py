"""Performance targets of geosharp, measured side by side in one run.

    python benchmarks/bench_targets.py                     # BERT-base-shaped, batch 8 x 128
    python benchmarks/bench_targets.py --quick             # small BERT, about a minute
    python benchmarks/bench_targets.py --batch 32          # a larger batch
    python benchmarks/bench_targets.py --profile           # where the time goes, per measure
    python benchmarks/bench_targets.py --autocast bf16     # forward/backward under autocast

Targets (ratios of times measured in this run, on this machine):

1. one Auto-PGD step <= 1.05x one forward+backward of the model on the same batch for
   adaptive sharpness, <= 1.10x for geodesic sharpness;
2. one geodesic step <= 1.05x one adaptive step (BERT-base-shaped attention), both metrics;
3. the batched horizontal projection >= 20x faster than a per-head
   ``scipy.linalg.solve_sylvester`` loop, 144 heads of h = 64;
4. peak memory <= the model + one training step (activations and gradient) + 4
   parameter-sized buffers (geodesic), 3 (adaptive: a straight step).

``--kept-gradient`` measures Auto-PGD with the reference's restart (the best point's
gradient kept, one buffer more; ``benchmarks/reference.py``) instead of geosharp's (the
best point evaluated again). The step timings count the forward+backward passes of each
call through the ``callback`` and print their number per step.

How each is measured:

* a step is ``(T(n_long) - T(n_short)) / (n_long - n_short)`` for whole
  ``geosharp.sharpness`` calls (set-up and the unperturbed loss cancel); the reference
  forward+backward is ``loss_fn(model, batch).backward()``, timed both with the model's
  gradients freshly allocated (``zero_grad(set_to_none=True)``, PyTorch's default) and
  accumulated into existing ones; the ratio uses the faster of the two. Every time is
  the median of ``--repeats`` interleaved runs, so that load from other processes hits
  all alike. A steadier second estimate times, inside one call, the loop's work outside
  the model's forward+backward (geometry and vector operations, independent of the
  batch size) and adds it to the reference forward+backward;
* the projection: ``state.project_horizontal`` of all heads at once (float64, state
  built once per base point, as in Auto-PGD) against, per head, ``solve_sylvester`` on
  the same equation (``A X + X A = C``, ``A = (G^T G)(H^T H)``) and the same correction;
* memory: on CPU every measurement runs in a fresh process; after a warm-up
  forward+backward, free heap memory is returned to the system (``malloc_trim``), the
  peak resident size is reset (``/proc/self/clear_refs``) and the increase of the peak
  over the resident size is recorded, for one training forward+backward (activations
  plus the model's gradients) and for a sharpness call. The count is
  ``(peak_sharpness - peak_training) / parameter bytes``: what the measure needs beyond
  a training step. On CUDA,
  ``torch.cuda.max_memory_allocated`` does the same in-process.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import json
import statistics
import subprocess
import sys
import time

import torch
from torch.nn import functional as F

import geosharp

MEASURES = ("adaptive", "geodesic-inv", "geodesic-mix")  # names of geosharp.measures.TABLE
RHO = {"adaptive": 0.01, "geodesic-inv": 0.01, "geodesic-mix": 0.001}


# -- models ------------------------------------------------------------------------------


def build(name: str, batch: int, seq: int, device: torch.device):
    """A random BERT classifier (``bert-base-shaped``: hidden 768, 12 heads of 64, 12
    layers, 110M parameters; ``small``: hidden 256, 4 heads of 64, 4 layers) and one
    batch of random tokens."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    if name == "bert-base-shaped":
        config = BertConfig(num_labels=2)
    elif name == "small":
        config = BertConfig(
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=1024,
            num_labels=2,
        )
    else:
        raise SystemExit(f"unknown model {name!r}")
    model = BertForSequenceClassification(config).to(device).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen).to(device)
    labels = torch.randint(0, 2, (batch,), generator=gen).to(device)

    def loss_fn(m, b):
        return F.cross_entropy(m(input_ids=b[0]).logits, b[1])

    return model, (ids, labels), loss_fn


def n_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast_context(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


# -- target 1 and 2: step times ----------------------------------------------------------


def measure(model, batch, loss_fn, kw, symmetries, autocast_dtype, n_iters, args, callback=None):
    """One ``geosharp.sharpness`` call: ``n_iters`` Auto-PGD steps of the measure ``kw`` on
    ``batch``, restarting as ``--kept-gradient`` asks (the reference's rule, or
    geosharp's)."""
    from reference import restart_rule

    with restart_rule(args.kept_gradient):
        return geosharp.sharpness(
            model,
            [batch],
            loss_fn,
            measure=kw,
            rho=RHO[kw],
            symmetries=symmetries,
            autocast_dtype=autocast_dtype,
            callback=callback,
            estimator=geosharp.WorstCase(n_iters=n_iters),
        )


def time_steps(args, device, autocast_dtype) -> dict:
    model, batch, loss_fn = build(args.model, args.batch, args.seq, device)
    symmetries = geosharp.find_symmetries(model)

    def fwd_bwd(set_to_none: bool) -> float:
        model.zero_grad(set_to_none=set_to_none)
        sync(device)
        start = time.perf_counter()
        with autocast_context(device, autocast_dtype):
            loss = loss_fn(model, batch)
        loss.backward()
        sync(device)
        return time.perf_counter() - start

    calls = {"n": 0}

    def count(event, i, iterate):
        calls["n"] += event == "evaluate"

    def run(kw, n) -> float:
        sync(device)
        start = time.perf_counter()
        measure(model, batch, loss_fn, kw, symmetries, autocast_dtype, n, args, count)
        sync(device)
        return time.perf_counter() - start

    fwd_bwd(True)  # warm-up
    fwd_bwd(False)
    for kw in MEASURES:
        run(kw, 1)
    fresh, kept = [], []
    steps = {k: [] for k in MEASURES}
    per_step = {k: [] for k in MEASURES}  # forward+backward passes per step
    for r in range(args.repeats):
        fresh.append(fwd_bwd(True))
        kept.append(fwd_bwd(False))
        for kw in MEASURES:
            calls["n"] = 0
            t_long = run(kw, args.n_long)
            calls_long, calls["n"] = calls["n"], 0
            t_short = run(kw, args.n_short)
            gap = args.n_long - args.n_short
            steps[kw].append((t_long - t_short) / gap)
            per_step[kw].append((calls_long - calls["n"]) / gap)
        print(
            f"  repeat {r + 1}/{args.repeats}: fwd+bwd {fresh[-1]:.3f}s / {kept[-1]:.3f}s, "
            + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in steps.items()),
            flush=True,
        )
    model.zero_grad(set_to_none=True)
    return {
        "n_parameters": n_parameters(model),
        "fwd_bwd_fresh_grads": statistics.median(fresh),
        "fwd_bwd_kept_grads": statistics.median(kept),
        "steps": {k: statistics.median(v) for k, v in steps.items()},
        "step_samples": steps,
        "fwd_bwd_per_step": per_step,
    }


def time_overhead(args, device, autocast_dtype) -> dict:
    """Seconds per step spent outside the model's forward+backward. For one ``sharpness``
    call, the work outside is the Auto-PGD loop's time (its ``"start"`` to ``"end"``
    callback events) minus the time inside every ``loss_grad`` call (``"evaluate"`` to
    ``"evaluated"``); the per-step value is the difference between ``n_long`` and
    ``n_short`` steps (one-time costs, such as first touches of the buffers, cancel).
    The model's own time is subtracted call by call, so its noise does not enter; the
    result does not depend on the batch size."""
    spent = {"loop": 0.0, "model": 0.0}
    clock = {}

    def callback(event, i, iterate):
        sync(device)
        now = time.perf_counter()
        if event in ("start", "evaluate"):
            clock[event] = now
        elif event == "end":
            spent["loop"] += now - clock["start"]
        elif event == "evaluated":
            spent["model"] += now - clock["evaluate"]

    model, batch, loss_fn = build(args.model, args.batch, args.seq, device)
    symmetries = geosharp.find_symmetries(model)
    out = {}
    for kw in MEASURES:
        samples = []
        for _ in range(args.repeats):
            outside = {}
            for n in (args.n_long, args.n_short):
                spent.update(loop=0.0, model=0.0)
                measure(model, batch, loss_fn, kw, symmetries, autocast_dtype, n, args, callback)
                outside[n] = spent["loop"] - spent["model"]
            gap = args.n_long - args.n_short
            samples.append((outside[args.n_long] - outside[args.n_short]) / gap)
        out[kw] = statistics.median(samples)
    return out


# -- target 3: batched projection against a per-head scipy loop ---------------------------


def time_projection(heads: int, n: int, h: int, repeats: int) -> dict:
    """The inv projection of ``heads`` pairs of ``(n x h)`` blocks, batched, against a
    per-head loop around ``scipy.linalg.solve_sylvester`` (numpy, float64). Timed: the
    Sylvester solve alone (``L`` from the h x h right-hand side), and the whole projection
    (right-hand side, solve, correction), with ``pairs.py``'s reference method and with
    the fused kernel of the inner loop (float64, and float32 as in a float32 model)."""
    import numpy as np
    from scipy.linalg import solve_sylvester

    from geosharp.geometry.pairs import InvMetric

    gen = torch.Generator().manual_seed(0)
    F64 = torch.float64
    G = torch.randn(heads, n, h, generator=gen, dtype=F64) / n**0.5
    H = torch.randn(heads, n, h, generator=gen, dtype=F64) / n**0.5
    xG, xH = torch.randn_like(G), torch.randn_like(H)
    start = time.perf_counter()
    state = InvMetric().state(G, H)
    setup = time.perf_counter() - start
    gram_g, gram_h = xG.mT @ G, H.mT @ xH  # the h x h reductions of x

    def best_of(fn, k=repeats):
        times = []
        for _ in range(k):
            start = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times), result

    # the solve alone, from the h x h reductions (a private method: timed, not tested)
    t_solve, L = best_of(lambda: state._coefficient(gram_g, gram_h))
    t_reference, ref_out = best_of(lambda: state.project_horizontal((xG, xH)))
    t_fused, out = best_of(lambda: state.proju((xG, xH)))
    x32 = (xG.float(), xH.float())
    t_fused32, _ = best_of(lambda: state.proju(x32))

    Gn, Hn, xGn, xHn = (t.numpy() for t in (G, H, xG, xH))
    P = np.einsum("bnh,bnk->bhk", Gn, Gn)
    Q = np.einsum("bnh,bnk->bhk", Hn, Hn)
    A = P @ Q
    C = gram_g.numpy() @ Q - P @ gram_h.numpy()

    def loop_solve():
        return [solve_sylvester(A[i], A[i], C[i]).T for i in range(heads)]

    def loop_projection():
        res = []
        for i in range(heads):
            g, hh, a, b = Gn[i], Hn[i], xGn[i], xHn[i]
            Pi, Qi = g.T @ g, hh.T @ hh
            Ci = a.T @ g @ Qi - Pi @ (hh.T @ b)
            Li = solve_sylvester(Pi @ Qi, Pi @ Qi, Ci).T  # A X + X A = C, X = L^T
            res.append((a - g @ Li, b + hh @ Li.T))
        return res

    k = max(1, repeats // 2)
    t_loop_solve, L_loop = best_of(loop_solve, k)
    t_loop, loop_out = best_of(loop_projection, k)
    err = max(
        max(
            float(np.abs(out[0][i].numpy() - loop_out[i][0]).max()),
            float(np.abs(out[1][i].numpy() - loop_out[i][1]).max()),
            float(np.abs(ref_out[0][i].numpy() - loop_out[i][0]).max()),
        )
        for i in range(heads)
    )
    err_solve = float(np.abs(L.numpy() - np.stack(L_loop)).max() / np.abs(np.stack(L_loop)).max())
    return {
        "heads": heads,
        "n": n,
        "h": h,
        "state_setup": setup,
        "solve_batched": t_solve,
        "solve_scipy_loop": t_loop_solve,
        "solve_rel_difference": err_solve,
        "projection_reference": t_reference,
        "projection_fused": t_fused,
        "projection_fused_float32": t_fused32,
        "projection_scipy_loop": t_loop,
        "max_abs_difference": err,
    }


# -- target 4: peak memory -----------------------------------------------------------------


def _rss_status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def run_once(mode: str, model, batch, loss_fn, symmetries, device, args) -> None:
    """One training forward+backward (``train``) or one sharpness call of 3 Auto-PGD
    steps (a measure name), whose memory is counted."""
    autocast_dtype = AUTOCAST[args.autocast]
    if mode == "train":
        with autocast_context(device, autocast_dtype):
            loss = loss_fn(model, batch)
        loss.backward()
        return
    measure(model, batch, loss_fn, mode, symmetries, autocast_dtype, 3, args)


def memory_child(mode: str, args) -> dict:
    """Run in a fresh process: the increase of the peak resident size over the resident
    size, for one forward+backward (``train``) or one sharpness call (a measure name)."""
    device = torch.device("cpu")
    autocast_dtype = AUTOCAST[args.autocast]
    model, batch, loss_fn = build(args.model, args.batch, args.seq, device)
    symmetries = geosharp.find_symmetries(model)
    with autocast_context(device, autocast_dtype):
        loss = loss_fn(model, batch)
    loss.backward()  # warm-up: the allocator has seen one step
    model.zero_grad(set_to_none=True)
    del loss
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _rss_status()["VmRSS"]
    run_once(mode, model, batch, loss_fn, symmetries, device, args)
    peak = _rss_status()["VmHWM"]
    return {"increase": peak - base, "parameter_bytes": 4 * n_parameters(model)}


def measure_memory(args, device) -> dict:
    if device.type == "cuda":
        return measure_memory_cuda(args, device)
    out = {}
    for mode in ["train", *MEASURES]:
        cmd = [
            sys.executable,
            __file__,
            "--memory-child",
            mode,
            "--model",
            args.model,
            "--batch",
            str(args.batch),
            "--seq",
            str(args.seq),
            "--autocast",
            args.autocast,
            *(["--kept-gradient"] if args.kept_gradient else []),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    return summarise_memory(out)


def measure_memory_cuda(args, device) -> dict:
    model, batch, loss_fn = build(args.model, args.batch, args.seq, device)
    symmetries = geosharp.find_symmetries(model)
    out = {}
    for mode in ["train", *MEASURES]:
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        run_once(mode, model, batch, loss_fn, symmetries, device, args)
        torch.cuda.synchronize(device)
        out[mode] = {
            "increase": torch.cuda.max_memory_allocated(device) - base,
            "parameter_bytes": 4 * n_parameters(model),
        }
    model.zero_grad(set_to_none=True)
    return summarise_memory(out)


def summarise_memory(raw: dict) -> dict:
    param = raw["train"]["parameter_bytes"]
    train = raw["train"]["increase"]
    return {
        "parameter_bytes": param,
        "train_increase": train,
        "buffers": {k: (v["increase"] - train) / param for k, v in raw.items() if k != "train"},
    }


# -- profile ---------------------------------------------------------------------------------


def profile(args, device, autocast_dtype) -> None:
    """torch.profiler over one sharpness call per measure, with geosharp's regions
    labelled; prints the operators and regions by total time."""
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    from geosharp.geometry import space

    def label(owner, name):
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapped(*a, **k):
            with record_function(f"geosharp::{owner.__name__}.{name}"):
                return original(*a, **k)

        setattr(owner, name, wrapped)

    for name in ["retr_", "pullback_", "direction_", "combine_"]:
        label(space.PerturbationSpace, name)
    regions = []

    def callback(event, i, iterate):
        if event == "evaluate":
            regions.append(record_function("geosharp::loss_grad"))
            regions[-1].__enter__()
        elif event == "evaluated":
            regions.pop().__exit__(None, None, None)

    model, batch, loss_fn = build(args.model, args.batch, args.seq, device)
    symmetries = geosharp.find_symmetries(model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for kw in MEASURES:
        measure(model, batch, loss_fn, kw, symmetries, autocast_dtype, 2, args)
        with torch_profile(activities=activities) as prof:
            measure(
                model, batch, loss_fn, kw, symmetries, autocast_dtype, args.n_long, args, callback
            )
        print(f"\n== profile: {kw}, {args.n_long} steps ==")
        sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=args.profile_rows))


# -- report --------------------------------------------------------------------------------

AUTOCAST = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def _row(target: str, value: float, limit: float, seconds, unit="x", at_least=False) -> dict:
    """One target line: ``value`` against ``limit`` (an upper bound unless ``at_least``)."""
    row = dict(target=target, value=value, limit=limit, unit=unit, seconds=seconds)
    if at_least:
        row["at_least"] = True
    row["ok"] = value >= limit if at_least else value <= limit
    return row


def report(args, device, timing, projection, memory) -> list[dict]:
    rows = []
    if timing is not None:
        ref = min(timing["fwd_bwd_fresh_grads"], timing["fwd_bwd_kept_grads"])
        steps = timing["steps"]
        for name, t in steps.items():
            limit = 1.05 if name == "adaptive" else 1.10
            rows.append(_row(f"1. {name} step / forward+backward", t / ref, limit, t))
        for name, extra in timing.get("overhead", {}).items():
            limit = 1.05 if name == "adaptive" else 1.10
            target = f"   {name}: fwd+bwd + in-loop work ({extra:.3f}s) / fwd+bwd"
            rows.append(_row(target, (ref + extra) / ref, limit, ref + extra))
        for name in ("geodesic-inv", "geodesic-mix"):
            target = f"2. {name} step / adaptive step"
            rows.append(_row(target, steps[name] / steps["adaptive"], 1.05, steps[name]))
            extra = timing.get("overhead")
            if extra:
                value = (ref + extra[name]) / (ref + extra["adaptive"])
                target = f"   {name}: same, from the in-loop work"
                rows.append(_row(target, value, 1.05, ref + extra[name]))
    if projection is not None:
        p = projection
        shape = f"{p['heads']} x ({p['n']}x{p['h']})"
        loop = "projection_scipy_loop"
        compared = [  # (target, batched time, per-head scipy loop time)
            (
                f"3. Sylvester solve, batched vs scipy loop ({p['heads']} x h={p['h']})",
                "solve_batched",
                "solve_scipy_loop",
            ),
            (f"3. projection, fused f64 vs scipy loop ({shape})", "projection_fused", loop),
            (f"   projection, fused f32 vs scipy loop ({shape})", "projection_fused_float32", loop),
            (
                f"   projection, pairs.py reference vs scipy loop ({shape})",
                "projection_reference",
                loop,
            ),
        ]
        for target, batched, reference in compared:
            value = p[reference] / p[batched]
            rows.append(_row(target, value, 20, p[batched], at_least=True))
    if memory is not None:
        for name, k in memory["buffers"].items():
            target = f"4. {name} peak: parameter-sized buffers"
            limit = 3 if name == "adaptive" else 4
            rows.append(_row(target, k, limit, None, unit=""))

    threads = torch.get_num_threads()
    print(
        f"\nmodel {args.model}, batch {args.batch} x {args.seq} tokens, device {device}, "
        f"{threads} threads, autocast {args.autocast}, median of {args.repeats} "
        f"(steps {args.n_short} -> {args.n_long})"
    )
    if timing is not None:
        print(
            f"parameters {timing['n_parameters']:,}; forward+backward "
            f"{timing['fwd_bwd_fresh_grads']:.3f}s (fresh gradients), "
            f"{timing['fwd_bwd_kept_grads']:.3f}s (gradients kept); forward+backward passes "
            "per Auto-PGD step: "
            + ", ".join(
                f"{k} {statistics.mean(v):.2f}" for k, v in timing["fwd_bwd_per_step"].items()
            )
        )
    if projection is not None:
        p = projection
        print(
            f"projection ({p['heads']} heads, G and H {p['n']} x {p['h']}, float64): scipy "
            f"loop {p['projection_scipy_loop'] * 1e3:.0f} ms, of which solve_sylvester "
            f"{p['solve_scipy_loop'] * 1e3:.0f} ms; "
            f"batched solve {p['solve_batched'] * 1e3:.1f} ms; "
            f"state set-up once per base point {p['state_setup'] * 1e3:.0f} ms; "
            f"max |difference| {p['max_abs_difference']:.1e}"
        )
    if memory is not None:
        mib = 2**20
        print(
            f"memory: parameters {memory['parameter_bytes'] / mib:.0f} MiB, one training "
            f"forward+backward raises the peak by {memory['train_increase'] / mib:.0f} MiB "
            "(activations and gradients); buffers: parameter-sized vectors beyond that"
        )
    print(f"\n{'target':<58} {'measured':>9} {'limit':>7} {'seconds':>9}  status")
    for row in rows:
        sign = ">=" if row.get("at_least") else "<="
        secs = "" if row["seconds"] is None else f"{row['seconds']:.3f}"
        print(
            f"{row['target']:<58} {row['value']:>8.2f}{row['unit']} {sign}{row['limit']:>5}"
            f"{row['unit']} {secs:>9}  {verdict(row['ok'])}"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="bert-base-shaped", choices=["bert-base-shaped", "small"]
    )
    parser.add_argument(
        "--quick", action="store_true", help="small model, fewer steps and repeats (about a minute)"
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--n-short", type=int, default=2)
    parser.add_argument("--n-long", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--autocast", default="none", choices=sorted(AUTOCAST))
    parser.add_argument(
        "--skip", default="", help="comma-separated: steps,overhead,projection,memory"
    )
    parser.add_argument("--profile", action="store_true", help="profile instead of measuring")
    parser.add_argument("--profile-rows", type=int, default=30)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument(
        "--kept-gradient",
        action="store_true",
        help="the reference's restart: the best point's gradient kept (one buffer more)",
    )
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.model = "small"
        args.n_short, args.n_long, args.repeats = 2, 4, 3
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, args)))
        return
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    autocast_dtype = AUTOCAST[args.autocast]
    if args.profile:
        profile(args, device, autocast_dtype)
        return
    skip = set(filter(None, args.skip.split(",")))
    timing = projection = memory = None
    if "steps" not in skip:
        print("timing steps ...", flush=True)
        timing = time_steps(args, device, autocast_dtype)
    if "overhead" not in skip and "steps" not in skip:
        print("timing the work outside forward+backward ...", flush=True)
        timing["overhead"] = time_overhead(args, device, autocast_dtype)
    if "projection" not in skip:
        print("timing the projection ...", flush=True)
        projection = time_projection(heads=144, n=769, h=64, repeats=max(3, args.repeats))
    if "memory" not in skip:
        print("measuring peak memory ...", flush=True)
        memory = measure_memory(args, device)
    rows = report(args, device, timing, projection, memory)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    args=vars(args),
                    device=str(device),
                    threads=torch.get_num_threads(),
                    timing=timing,
                    projection=projection,
                    memory=memory,
                    rows=rows,
                ),
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
