"""Worker for tests/test_fsdp.py (its processes get torchrun's environment): every case
is measured on the unsharded model and on the same model sharded with
geosharp.fsdp.shard; rank 0 writes the values and the model check to ``argv[1]`` as
JSON."""

import contextlib
import copy
import json
import sys
import warnings

import torch

torch.set_num_threads(1)
import geosharp  # noqa: E402
from geosharp import distributed as gd  # noqa: E402
from geosharp import fsdp  # noqa: E402


def bert(dtype, heads=4, hidden=16):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=40, hidden_size=hidden, num_hidden_layers=2,
                        num_attention_heads=heads, intermediate_size=24,
                        max_position_embeddings=16, num_labels=3,
                        attn_implementation="eager")  # fmt: skip
    model = BertForSequenceClassification(config).to(dtype)
    g = torch.Generator().manual_seed(1)
    batches = [
        {"input_ids": torch.randint(0, 40, (6, 8), generator=g),
         "labels": torch.randint(0, 3, (6,), generator=g)}
        for _ in range(2)
    ]  # fmt: skip
    return model, batches


def llama(dtype, kv=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv, head_dim=4,
                         max_position_embeddings=32, attn_implementation="eager")  # fmt: skip
    model = LlamaForCausalLM(config).to(dtype)
    g = torch.Generator().manual_seed(2)
    batches = [{"input_ids": (ids := torch.randint(0, 50, (4, 10), generator=g)), "labels": ids}
               for _ in range(2)]  # fmt: skip
    return model, batches


def loss_fn(model, batch):
    return model(**batch).loss


def alone(*args, **kwargs) -> float | None:
    """``geosharp.sharpness(*args, **kwargs).value`` on rank 0 only (``None`` elsewhere):
    a one-process reference, which the other processes do not repeat on the shared cores
    (they wait at the next collective)."""
    import torch.distributed as dist

    return geosharp.sharpness(*args, **kwargs).value if dist.get_rank() == 0 else None


# two steps: the second retracts, pulls back and steps from a point off theta
CASES = {
    "worst": dict(estimator=geosharp.WorstCase(n_iters=2)),
    "worst-random": dict(estimator=geosharp.WorstCase(n_iters=2, starts="random"), seed=3),
    "average": dict(estimator=geosharp.AverageCase(n_samples=2), seed=5),
}
MEASURES = {
    "adaptive": 0.05,
    "geodesic-inv": 0.05,
    "geodesic-mix": 0.01,
    "euclidean": 0.01,
    "adaptive-attn": 0.05,  # the pairs only
    "geodesic-inv-attn": 0.05,
}


BASE_READS = [0]  # calls of ShardedStack.read_params: the pair states reading their blocks
SPLIT_RUNS: list[bool] = []  # per position index of a cut row's buffer: held as runs
HELD = [0]  # stacks with rows here, none cut, whose pair states hold a copy of their blocks
CUT = [0, 0]  # stacks with rows cut across processes whose pair states hold / read them


def _count_base_reads() -> None:
    from geosharp.geometry.sharded import ShardedStack

    read, reader = ShardedStack.read_params, ShardedStack.base_reader

    def counted(self, *args, **kwargs):
        BASE_READS[0] += 1
        return read(self, *args, **kwargs)

    def held(self, params):
        out = reader(self, params)
        uncut = all(x is None for x in self.exchange)
        HELD[0] += out is None and uncut and self.shapes[0][0] > 0
        CUT[0 if out is None else 1] += not uncut
        return out

    ShardedStack.read_params, ShardedStack.base_reader = counted, held

    from geosharp.geometry import sharded

    split = sharded._split

    def runs(*args):
        out = split(*args)
        if out is not None:
            held = (out.mine_runs, out.mine_at_runs, out.block_runs, out.block_at_runs)
            SPLIT_RUNS.extend(r.explicit is None for r in held)
        return out

    sharded._split = runs


GATHERS = {"forward": 0, "backward": 0}  # FSDP2 parameter groups gathered, by pass
CHECKED = {"forward": 0, "backward": 0}  # of them, by the set-up's check of reads


def _count_gathers() -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    unshard = FSDPParamGroup.unshard

    def counted(self, async_op=False):
        sharded = self._all_gather_result is None and not self.is_unsharded
        out = unshard(self, async_op)
        if sharded and (self._all_gather_result is not None or self.is_unsharded):
            backward = self._training_state == TrainingState.PRE_BACKWARD
            GATHERS["backward" if backward else "forward"] += 1
        return out

    FSDPParamGroup.unshard = counted

    from geosharp.measures.fsdp import ShardedGathered

    check = ShardedGathered.read_elsewhere

    def checked(self, *args, **kwargs):
        before = dict(GATHERS)
        try:
            return check(self, *args, **kwargs)
        finally:
            for k in CHECKED:
                CHECKED[k] += GATHERS[k] - before[k]

    ShardedGathered.read_elsewhere = checked


COLLECTIVES = {"forwards": 0, "gathers": 0, "scatters": 0}  # geosharp's own, on its point


def _count_collectives() -> None:
    from geosharp.measures import fsdp as sharded

    gather, scatter, holding = sharded._gather, sharded._scatter, sharded.ShardedGathered.holding

    def gathered(*args):
        COLLECTIVES["gathers"] += 1
        return gather(*args)

    def scattered(*args):
        COLLECTIVES["scatters"] += 1
        return scatter(*args)

    @contextlib.contextmanager
    def held(self, *args, **kwargs):
        COLLECTIVES["forwards"] += 1
        with holding(self, *args, **kwargs):
            yield

    sharded._gather, sharded._scatter = gathered, scattered
    sharded.ShardedGathered.holding = held


def units(model) -> int:
    """How many groups a forward gathers when every parameter is perturbed: each FSDP2
    module below the root (a layer) that holds parameters, and each module with
    parameters of its own outside them."""
    from torch.distributed.fsdp import FSDPModule

    below = [n for n, m in model.named_modules() if n and isinstance(m, FSDPModule)]
    found = set()
    for name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is not None:
            within = [u for u in below if name == u or name.startswith(u + ".")]
            found.add(max(within, key=len) if within else name)
    return len(found)


def unshard_flags(model) -> list[bool]:
    """Whether FSDP2 gathers each parameter group of ``model`` as it did: its
    ``unshard_in_backward`` on, its ``unshard`` the class's own."""
    from geosharp.measures.fsdp import _param_groups

    groups = _param_groups(model)
    assert groups, "no FSDP2 parameter groups found"  # the check could not fail
    return [group.unshard_in_backward and "unshard" not in vars(group) for group in groups]


def plan(name: str) -> list[tuple[str, str]]:
    """The ``(measure, case)`` pairs a run measures: every pair on the float64 BERT; on
    the other runs every measure's worst case from zero, and random starts and the
    average case where the pair sampler draws on sharded rows (``inv``, ``mix``); on
    the 4 processes' float64 LLaMA each geometry and sampler once."""
    if name == "bert-float64":
        return [(m, c) for m in MEASURES for c in CASES if "attn" not in m or c == "worst"]
    if name.endswith("bfloat16"):  # attention-only, and the whole model (embeddings, norms)
        return [("geodesic-inv-attn", "worst"), ("adaptive-attn", "worst"), ("adaptive", "worst")]
    if name == "llama-float64":  # 4 processes, two holding no rows of a key/value stack:
        # each geometry once, and the pair samplers; the other measures as on 2 processes
        return [
            ("adaptive", "worst"),
            ("geodesic-inv", "worst"),
            ("geodesic-inv-attn", "worst"),
            ("geodesic-mix", "worst-random"),
            ("geodesic-inv", "average"),
        ]
    out = [(m, "worst") for m in MEASURES if m != "adaptive-attn"]
    return out + [(m, c) for m in ("geodesic-inv", "geodesic-mix") for c in CASES if c != "worst"]


def errors():
    """What a sharded model that geosharp cannot measure gets: the messages."""
    from torch.distributed.fsdp import fully_shard

    out = {}
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True))
    plain = plain.to(torch.float64).eval()
    # its attention holds in_proj_weight and has a submodule: the point is written into
    # the shards (not gathered), and the base point written back
    unsharded = copy.deepcopy(plain)
    fully_shard(plain)
    x = torch.randn(2, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    before = [p.to_local().clone() for p in plain.parameters()]
    kw = dict(rho=0.05, estimator=geosharp.WorstCase(n_iters=3))
    out["written into the shards"] = [
        geosharp.sharpness(m, [x], lambda m, b: m(b).square().mean(), "adaptive", **kw).value
        for m in (unsharded, plain)
    ] + [all(torch.equal(b, p.to_local()) for b, p in zip(before, plain.parameters()))]
    out.update(hand_written())
    model, batches = bert(torch.float64, heads=3, hidden=12)  # its middle head cut
    default_plan(model)
    adaptive = geosharp.sharpness(
        model, batches, loss_fn, "adaptive", estimator=geosharp.WorstCase(n_iters=2)
    )
    out["adaptive needs no pairs"] = adaptive.value
    # FSDP2's default plan keeps whole rows when the heads divide over the processes
    model, batches = bert(torch.float64, heads=4)  # 2 heads on each process
    symmetries = geosharp.find_symmetries(model, batches[0], loss_fn=loss_fn)
    plain = copy.deepcopy(model)
    for layer in model.bert.encoder.layer:
        fully_shard(layer)
    fully_shard(model)
    kw = dict(rho=0.05, estimator=geosharp.WorstCase(n_iters=3), symmetries=symmetries)
    out["default plan"] = [
        alone(plain, batches, loss_fn, "geodesic-inv", **kw),
        geosharp.sharpness(model, batches, loss_fn, "geodesic-inv", **kw).value,
    ]
    # each process holds the rows of its heads: the others' are not kept; random
    # tangents are drawn for every head on every process
    drawn = dict(kw, estimator=geosharp.AverageCase(n_samples=2), seed=7)
    out["default plan, random"] = [
        value
        for measure in ("geodesic-inv", "geodesic-mix")
        for value in (
            alone(plain, batches, loss_fn, measure, **drawn),
            geosharp.sharpness(model, batches, loss_fn, measure, **drawn).value,
        )
    ]
    # no symmetries passed: found on the sharded model's structure (meta device)
    kw.pop("symmetries")
    found = geosharp.sharpness(model, batches, loss_fn, "geodesic-inv", **kw)
    out["default plan, pairs from the structure"] = [found.value, found.settings["n_pairs"]]
    out["pairs found before sharding"] = len(symmetries.pairs)
    out.update(half_precision())
    out["read elsewhere"] = read_elsewhere()
    for key, call in {
        "hessian": lambda: geosharp.hessian_trace(model, batches, loss_fn, "adaptive"),
        "per": lambda: geosharp.block_sharpness(model, batches, loss_fn, "adaptive", per="layer"),
    }.items():
        try:
            call()
            out[key] = None
        except geosharp.UsageError as e:
            out[key] = str(e)
    return out


def hand_written():
    """Attention written by hand (not a Hugging Face model; 2 heads of 4 rows, one on
    each process under FSDP2's default plan), passed no symmetries: its pairs are traced on
    its structure on the meta device and checked on the sharded model. ``[one process
    with the pairs found on the unsharded model, sharded, pairs, verified]``; a loss
    that needs values (through NumPy) cannot be traced on the meta device: the message."""
    from torch.distributed.fsdp import fully_shard

    import attention_zoo as zoo

    case = next(c for c in zoo.CASES if c.name == "plain")
    model, x = zoo.build(case)
    model.blocks.append(zoo.Plain().to(torch.float64).eval())  # two layers
    symmetries = geosharp.find_symmetries(model, x, loss_fn=zoo.loss_fn)
    plain = copy.deepcopy(model)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    kw = dict(rho=0.05, estimator=geosharp.WorstCase(n_iters=2))
    one = alone(plain, [x], zoo.loss_fn, "geodesic-inv", symmetries=symmetries, **kw)
    many = geosharp.sharpness(model, [x], zoo.loss_fn, "geodesic-inv", **kw)
    out = {
        "hand-written": [one, many.value, len(symmetries.pairs),
                         many.settings["n_pairs"], many.symmetry["verified"]],
    }  # fmt: skip

    def valued(m, x):
        loss = zoo.loss_fn(m, x)
        return loss * (1.0 + 0.0 * float(loss.detach().cpu().numpy()))

    try:
        geosharp.sharpness(model, [x], valued, "geodesic-inv", **kw)
        out["no symmetries"] = None
    except geosharp.UsageError as e:
        out["no symmetries"] = str(e)
    model = plain = None
    out["tied"] = tied_across_layers(kw)
    out["no grad"] = without_grad(kw)
    return out


class Statistic(torch.nn.Module):
    """A layer whose first ``Linear`` computes without gradient (a statistic that scales
    the second's output): both are perturbed, only the second has a gradient."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            scale = self.a(x).tanh()
        return self.b(x) * scale


def without_grad(kw):
    """Two :class:`Statistic` layers, each sharded: a layer's perturbed parameters are
    gathered together, and the one its first owner gathers without gradient is not the
    one the second computes on. ``[one process, sharded]``."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(Statistic(), Statistic()).to(torch.float64)
    x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def loss(m, x):
        return m(x).pow(2).mean()

    plain = copy.deepcopy(model)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    kw = {**kw, "symmetries": geosharp.find_symmetries(plain, x, loss_fn=loss)}
    one = alone(plain, [x], loss, "adaptive", **kw)
    return [one, geosharp.sharpness(model, [x], loss, "adaptive", **kw).value]


def tied_across_layers(kw):
    """The query weight of two layers tied (FSDP2 takes tied layers as one group): the
    second layer's pairs' unit holds both layers, FSDP modules, so its value-output pair
    is used unchecked; the query-key pairs are left out. ``[one process, sharded,
    unverified, the measure's warnings]``."""
    from torch.distributed.fsdp import fully_shard

    import attention_zoo as zoo

    model, x = zoo.build(next(c for c in zoo.CASES if c.name == "plain"))
    model.blocks.append(zoo.Plain().to(torch.float64).eval())
    model.blocks[1].q.weight = model.blocks[0].q.weight
    plain = copy.deepcopy(model)
    fully_shard(list(model.blocks))
    fully_shard(model)
    one = alone(plain, [x], zoo.loss_fn, "geodesic-inv", **kw)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        many = geosharp.sharpness(model, [x], zoo.loss_fn, "geodesic-inv", **kw)
    said = [str(w.message) for w in said if w.category is geosharp.SymmetryWarning]
    return [one, many.value, many.symmetry["unverified"], said]


def default_plan(model):
    """FSDP2's default plan, ``Shard(0)`` everywhere: each layer, then the model."""
    from torch.distributed.fsdp import fully_shard

    layers = model.bert.encoder.layer if hasattr(model, "bert") else model.model.layers
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)


SPLIT = {  # FSDP2's default plan cuts the rows of these heads over 2 and over 4 processes
    "bert": (lambda: bert(torch.float64, heads=3, hidden=12), 0.05),  # heads of 4 rows of 12
    "llama": (lambda: llama(torch.float64, kv=1), 0.05),  # one key/value head of 4 rows
    "llama-bfloat16": (lambda: llama(torch.bfloat16, kv=1), 1.0),
}


def split_plan(name: str, world: int) -> list[tuple[str, str]]:
    """Every case on the BERT on 2 processes (its middle head cut); on more (every head
    cut, a process holding rows of two heads) each geometry's worst case and one pair
    sampler each. On the LLaMA (rotary subgroup on query/key) the worst case of ``inv``
    from zero and the average case of ``mix`` (its sampler)."""
    if name == "llama-bfloat16":
        return [("geodesic-inv-attn", "worst")]
    if name == "llama":
        return [("geodesic-inv", "worst"), ("geodesic-mix", "average")]
    if world > 2:
        return [("geodesic-inv", "worst"), ("geodesic-inv", "worst-random"),
                ("geodesic-mix", "worst"), ("geodesic-mix", "average")]  # fmt: skip
    return [("geodesic-inv", c) for c in CASES] + [("geodesic-mix", c) for c in CASES]


def runs_measures(world: int) -> tuple[str, ...]:
    """The geometries measured with every stack cut into runs of one head: both on 2
    processes; on more (each run cut, a process holding two) ``inv`` (their stacks and
    runs are the same code)."""
    return ("geodesic-inv", "geodesic-mix") if world == 2 else ("geodesic-inv",)


def rotary_runs(one_head) -> dict:
    """On 2 processes, a LLaMA with two key/value heads under FSDP2's default plan: its
    rotary pairs' stacks cut into runs of one key/value head (``one_head``, a
    :func:`~geosharp.geometry.stacked.max_stack`), each run on one process only, the
    other holding no head of that stack; and whole stacks (both layers in one, a key/value
    head's query rows held by one process). ``[one process, sharded]`` per measure, and
    the runs' pair states that hold their blocks."""
    from geosharp.geometry import sharded, stacked

    kept, out = stacked.max_stack, {}
    rotary, data = llama(torch.float64, kv=2)
    found = geosharp.find_symmetries(rotary, data[0], loss_fn=loss_fn)
    plain_rotary = copy.deepcopy(rotary)
    default_plan(rotary)
    held = 0
    for measure in ("geodesic-inv", "geodesic-mix"):
        kw = dict(rho=0.05, symmetries=found, **CASES["worst"])
        sharded.max_stack = stacked.max_stack = kept
        one = alone(plain_rotary, data, loss_fn, measure, **kw)
        for key, size in (("whole", kept), ("runs", one_head)):
            sharded.max_stack = stacked.max_stack = size
            held_before = HELD[0]
            many = geosharp.sharpness(rotary, data, loss_fn, measure, **kw).value
            held += (HELD[0] - held_before) if key == "runs" else 0
            out[f"llama/{key}/{measure}"] = [one, many]
    sharded.max_stack = stacked.max_stack = kept
    out["llama/held"] = held
    return out


def split_heads():
    """Models whose heads FSDP2's default plan cuts across processes: ``[one process,
    sharded]`` per measure and case, the pairs found before sharding and on the sharded
    model's structure (on 2 processes), and whether the shards are unchanged afterwards."""
    out, world = {}, torch.distributed.get_world_size()
    del SPLIT_RUNS[:]
    CUT[:] = [0, 0]
    for name, (build, rho) in SPLIT.items():
        model, batches = build()
        symmetries = geosharp.find_symmetries(model, batches[0], loss_fn=loss_fn)
        plain = copy.deepcopy(model)
        default_plan(model)
        before = [p.to_local().clone() for p in model.parameters()]
        for measure, case in split_plan(name, world):
            kw = dict(rho=rho, symmetries=symmetries, **CASES[case])
            out[f"{name}/{measure}/{case}"] = [
                alone(plain, batches, loss_fn, measure, **kw),
                geosharp.sharpness(model, batches, loss_fn, measure, **kw).value,
            ]
        if name == "bert":  # stacks cut into runs of one head each (on every process):
            # the value without runs, in one process
            from geosharp.geometry import sharded, stacked

            kept = stacked.max_stack

            def one_head(device, sharded=False):
                return 1

            sharded.max_stack = stacked.max_stack = one_head
            for measure in runs_measures(world):
                kw = dict(rho=rho, symmetries=symmetries, **CASES["worst"])
                out[f"bert/runs/{measure}"] = [
                    out[f"bert/{measure}/worst"][0],
                    geosharp.sharpness(model, batches, loss_fn, measure, **kw).value,
                ]
            sharded.max_stack = stacked.max_stack = kept
            if world == 2:
                out.update(rotary_runs(one_head))
        if name == "bert" and world == 2:  # no symmetries passed: found on the structure
            # (meta device) and checked on the sharded model, its units' weights gathered
            kw = dict(rho=rho, **CASES["worst"])
            found = geosharp.sharpness(model, batches, loss_fn, "geodesic-inv", **kw)
            out["bert/structure"] = [found.value, found.settings["n_pairs"],
                                     len(symmetries.pairs), found.symmetry["verified"],
                                     found.symmetry["unverified"]]  # fmt: skip
            # a query squashed by a hook: the structure still shows the pair, the check
            # on the sharded model refutes it
            query = model.bert.encoder.layer[0].attention.self.query
            hook = query.register_forward_hook(lambda m, args, y: torch.tanh(y))
            refuted = geosharp.sharpness(model, batches, loss_fn, "geodesic-inv", **kw)
            hook.remove()
            out["bert/refuted"] = [refuted.settings["n_pairs"], refuted.symmetry["verified"],
                                   refuted.symmetry["unverified"]]  # fmt: skip
        out[f"{name}/unchanged"] = all(
            torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters())
        ) and all(p.grad is None for p in model.parameters())
    out["split positions as runs"] = [sum(SPLIT_RUNS), len(SPLIT_RUNS)]
    out["cut stacks holding, reading their blocks"] = list(CUT)
    return out


class Residual(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class TiedHead(torch.nn.Module):
    """A language model whose output reads its embedding's weight itself (an
    x-transformers-like tied head): a read outside the forward of the module that
    holds the weight."""

    def __init__(self, vocab: int = 20, dim: int = 8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(Residual(dim) for _ in range(2))
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x) @ self.emb.weight.T


def read_elsewhere():
    """:class:`TiedHead` sharded (each layer, then the root: the embedding and the norm),
    measured whole and on the embedding alone (its FSDP group then also holds the norm,
    not perturbed): float64 equals one process, the point written into the shards (the
    owners' gathers would leave the head's read unperturbed); bfloat16 is refused. The
    control: float64 on the embedding alone without the check, measured on the owners'
    gathers, gets another value."""
    from torch.distributed.fsdp import fully_shard

    from geosharp.measures import fsdp as measures_fsdp
    from geosharp.measures.fsdp import ShardedGathered

    def loss(m, ids):
        logits = m(ids)
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())

    ids = torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(0))
    out = {}
    for dtype in (torch.float64, torch.bfloat16):
        torch.manual_seed(0)
        model = TiedHead().to(dtype)
        plain = copy.deepcopy(model)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        before = [p.to_local().clone() for p in model.parameters()]
        for parameters in (None, ["emb.weight"]):
            kw = dict(rho=0.5, estimator=geosharp.WorstCase(n_iters=2), parameters=parameters)
            key = f"{dtype}/{'whole' if parameters is None else 'embedding'}"
            try:
                many = geosharp.sharpness(model, [ids], loss, "adaptive", **kw)
                out[key] = [alone(plain, [ids], loss, "adaptive", **kw), many.value,
                            many.settings["sharded_point"]]  # fmt: skip
            except geosharp.UsageError as e:
                out[key] = str(e)
        if dtype == torch.float64:
            check = ShardedGathered.read_elsewhere
            ShardedGathered.read_elsewhere = lambda self, base, batch: None
            try:
                unchecked = geosharp.sharpness(model, [ids], loss, "adaptive", **kw)
                out["unchecked"] = [unchecked.value, unchecked.settings["sharded_point"]]
            finally:
                ShardedGathered.read_elsewhere = check
        # a torch whose FSDP2 groups geosharp cannot read: float64 written into its shards
        # (the one-process value), bfloat16 measured with a warning
        groups, measures_fsdp._param_groups = measures_fsdp._param_groups, lambda model: []
        try:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                unread = geosharp.sharpness(model, [ids], loss, "adaptive", **kw)
            out[f"{dtype}/groups unread"] = [
                unread.value,
                [str(w.message) for w in said],
                unread.settings["sharded_point"],
            ]
        finally:
            measures_fsdp._param_groups = groups
        out[f"{dtype}/unchanged"] = all(
            torch.equal(b, p.to_local()) and p.grad is None and p.requires_grad
            for b, p in zip(before, model.parameters())
        )
    return out


def half_precision():
    """bfloat16 shards: a tied embedding and output head (two gathers of one slice), a
    loss that raises (the model as it was, hooks and all), and a module that owns a
    perturbed parameter and has submodules (refused)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                         tie_word_embeddings=True, attn_implementation="eager")  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    _, batches = llama(torch.bfloat16)
    symmetries = geosharp.find_symmetries(model, batches[0], loss_fn=loss_fn)
    plain = copy.deepcopy(model)
    fsdp.shard(model, symmetries)
    kw = dict(rho=1.0, estimator=geosharp.WorstCase(n_iters=2))
    out = {"bfloat16 tied": [geosharp.sharpness(m, batches, loss_fn, "adaptive", **kw).value
                             for m in (plain, model)]}  # fmt: skip

    def hooks():
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())

    before = hooks()

    def raising(m, batch):
        m(**batch)
        raise KeyError("raised by the loss")

    try:
        geosharp.sharpness(model, batches, raising, "adaptive", **kw)
    except KeyError:
        out["bfloat16 after raising"] = [
            hooks() == before and all(unshard_flags(model)),
            all(isinstance(p, DTensor) and p.requires_grad for p in model.parameters()),
            geosharp.sharpness(model, batches, loss_fn, "adaptive", **kw).value,
        ]
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).to(torch.bfloat16)
    fully_shard(layer)
    try:  # its attention holds in_proj_weight and has out_proj
        x = torch.zeros(2, 3, 8, dtype=torch.bfloat16)
        geosharp.sharpness(layer, [x], lambda m, b: m(b).float().sum(), "adaptive")
        out["bfloat16 owner with submodules"] = None
    except geosharp.UsageError as e:
        out["bfloat16 owner with submodules"] = str(e)
    return out


def checkpointed():
    """The bfloat16 and float32 LLaMA with Hugging Face's activation checkpointing, kept
    on during the measure, sharded and not: ``[one process, sharded, kept]``; bfloat16
    also with its perturbed products forced into parts (``bfloat16 split``, the
    records' precision after)."""
    from geosharp.measures.backends import split

    out = {}
    for dtype in ("bfloat16", "float32"):
        model, batches = llama(getattr(torch, dtype))
        symmetries = geosharp.find_symmetries(model, batches[0], loss_fn=loss_fn)
        plain = copy.deepcopy(model)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        fsdp.shard(model, symmetries)
        kw = dict(rho=1.0, estimator=geosharp.WorstCase(n_iters=2))
        for forced in (False, True) if dtype == "bfloat16" else (False,):
            was, split.ENABLED = split.ENABLED, True if forced else split.ENABLED
            try:
                for measure in ("geodesic-inv-attn", "adaptive"):
                    one = alone(plain, batches, loss_fn, measure, **kw)
                    many = geosharp.sharpness(model, batches, loss_fn, measure, **kw)
                    key = f"{dtype}{' split' if forced else ''}/{measure}"
                    out[key] = [one, many.value, many.settings["checkpointing"]]
                    if forced:
                        out[key].append(many.settings["precision"])
            finally:
                split.ENABLED = was
    return out


def sam(name):
    """Three GeodesicSAM steps (SGD) on the unsharded and on the sharded model, the same
    batches on every process: ``[largest relative difference of the weights after,
    how far the steps moved them]`` per measure."""
    from geosharp.training.optim import GeodesicSAM

    arch, dtype = name.split("-")
    out = {}
    for measure in ("geodesic-inv", "adaptive"):
        model, batches = {"bert": bert, "llama": llama}[arch](getattr(torch, dtype))
        model.eval()  # no dropout
        symmetries = geosharp.find_symmetries(model, batches[0], loss_fn=loss_fn)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        plain = copy.deepcopy(model)
        fsdp.shard(model, symmetries)
        for m in (plain, model):
            opt = GeodesicSAM(m, torch.optim.SGD, rho=0.05, measure=measure, lr=0.1,
                              symmetries=symmetries)  # fmt: skip
            for step in range(3):
                loss_fn(m, batches[step % 2]).backward()
                opt.first_step(zero_grad=True)
                loss_fn(m, batches[step % 2]).backward()
                opt.second_step(zero_grad=True)
        ref = dict(plain.named_parameters())
        # a weight the loss does not depend on (BERT's key bias: softmax ignores a shift)
        # moves by round-off only, from 0: its scale is the model's, not its own 1e-24
        floor = 1e-12 * max(float(p.detach().abs().max()) for p in ref.values())
        worst, moved = 0.0, 0.0
        for n, p in model.named_parameters():
            whole = p.detach().full_tensor()
            scale = max(float(ref[n].detach().abs().max()), floor)
            worst = max(worst, float((whole - ref[n].detach()).abs().max()) / scale)
            moved = max(moved, float((ref[n].detach() - start[n]).abs().max()) / scale)
        out[measure] = [worst, moved]
    return out


def split_products(model, plain, batches, measure, kw) -> dict:
    """The measure with the perturbed matrices' products forced into bfloat16 parts
    (``split.ENABLED``; this CPU keeps float32 products by default), sharded (around
    the gathered point's own rounding: the call is collective) and in one process
    (around the weight, rank 0, ``plain``): values, floors, records and the products
    split."""
    from geosharp.measures.backends import split

    real, was, calls = split.split_product, split.ENABLED, []

    def counted(*args):
        calls.append(1)
        return real(*args)

    split.split_product, split.ENABLED = counted, True
    try:
        many = geosharp.sharpness(model, batches, loss_fn, measure, **kw)
        products = len(calls)
        if plain is None:  # not rank 0
            return {}
        one = geosharp.sharpness(plain, batches, loss_fn, measure, **kw)
    finally:
        split.split_product, split.ENABLED = real, was
    return {
        "many": many.value, "one": one.value, "floor": [many.floor, one.floor],
        "precision": [many.settings["precision"], one.settings["precision"]],
        "products": [products, len(calls) - products],
    }  # fmt: skip


def main():
    out, which = sys.argv[1], sys.argv[2:]
    _count_base_reads()
    _count_gathers()
    _count_collectives()
    rank, world = gd.init()
    results = {}
    if "errors" in which:
        which.remove("errors")
        results["errors"] = errors()
    if "split" in which:
        which.remove("split")
        results["split"] = split_heads()
    if "checkpointed" in which:
        which.remove("checkpointed")
        results["checkpointed"] = checkpointed()
    for name in [w for w in which if w.startswith("sam:")]:
        which.remove(name)
        results[name] = sam(name.removeprefix("sam:"))
    for name in which:
        arch, dtype = name.split("-")
        model, batches = {"bert": bert, "llama": llama}[arch](getattr(torch, dtype))
        symmetries = geosharp.find_symmetries(model, batches[0], loss_fn=loss_fn)
        plain = copy.deepcopy(model)
        # a half-precision model: also the same measure on a float32 copy of its weights
        wide = copy.deepcopy(model).float() if dtype == "bfloat16" else None
        fsdp.shard(model, symmetries)
        results[f"{name}/units"] = units(model)
        before = [p.to_local().clone() for p in model.parameters()]
        gathers = dict(GATHERS)
        loss_fn(model, batches[0]).backward()  # a training step: FSDP gathers every layer
        results[f"{name}/step gathers"] = [GATHERS[k] - gathers[k] for k in gathers]
        model.zero_grad(set_to_none=True)
        for measure, case in plan(name):
            # bfloat16: a radius whose values its round-off barely moves (about 1 %)
            kw = {"rho": 1.0 if wide is not None else MEASURES[measure], **CASES[case]}
            reads, held, gathers, checked = BASE_READS[0], HELD[0], dict(GATHERS), dict(CHECKED)
            collectives = dict(COLLECTIVES)
            many = geosharp.sharpness(model, batches, loss_fn, measure, **kw)
            reads, held = BASE_READS[0] - reads, HELD[0] - held
            collectives = {k: COLLECTIVES[k] - v for k, v in collectives.items()}
            checked = [CHECKED[k] - checked[k] for k in checked]
            gathers = [GATHERS[k] - gathers[k] - c for k, c in zip(gathers, checked)]
            if wide is not None and world == 2:  # collective: every rank
                parts = split_products(model, plain if rank == 0 else None, batches, measure, kw)
            if rank != 0:  # the one-process references (and the results) are rank 0's
                continue
            one = geosharp.sharpness(plain, batches, loss_fn, measure, **kw)
            results[f"{name}/{measure}/{case}"] = {
                "one": one.per_batch, "many": many.per_batch,
                "loss": [one.loss, many.loss], "world": many.settings.get("sharded"),
                "precision": many.settings["precision"], "floor": many.floor,
                "gradient": [one.settings["gradient"], many.settings["gradient"]],
                "base reads": reads, "held": held, "gathers": gathers, "checked": checked,
                "collectives": collectives,
            }  # fmt: skip
            if wide is not None:
                kw["symmetries"] = symmetries  # found on the half-precision model
                float32 = geosharp.sharpness(wide, batches, loss_fn, measure, **kw)
                results[f"{name}/{measure}/{case}"]["float32"] = float32.value
                if world == 2:
                    results[f"{name}/{measure}/{case}"]["split"] = parts
        same = all(torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters()))
        grads = all(p.grad is None for p in model.parameters())
        flags = all(unshard_flags(model))  # FSDP gathers again, as it did
        results[f"{name}/model unchanged"] = bool(same and grads and flags)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"world": world, "results": results}, f)
    model = plain = None  # the sharded model released before the group ends
    gd.close()


if __name__ == "__main__":
    main()
