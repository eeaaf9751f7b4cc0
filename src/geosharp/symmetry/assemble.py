r"""From a traced forward pass (:mod:`geosharp.symmetry.trace`) to ``GL`` pairs.

**Query/key.** Every attention *core* contracts two projections over their features,
slice by slice (one slice per head, per batch element). The columns of one slice of
one operand are a *node*: the features it holds, column by column. A node and the node
it meets are the two sides of one bilinear form, so the symmetry ``(G, H) -> (G A,
H A^{-T})`` must act on both with one ``A``: nodes are joined into components by the
cores they meet in (grouped-query heads: one key node meets several query nodes;
DeBERTa: queries and keys also meet the other side's position projections), and each
component, two-coloured, is one pair, ``G`` stacking the rows of one side's nodes and
``H`` the other's. A node's rows are its projection's weight rows (one per input), its
bias and any parameter added to it later.

**Value/output.** Scores mix features over tokens, slice by slice; the features mixed
in one slice (a value head) stay in their columns until a weight consumes them (the
output projection). The value head's rows form ``G``; the weight's columns that read
each of its features form ``H`` (stacked when several query heads read one value
head).

**Groups.** A column whose element is its own feature plus a partner feature of the
same node is rotated with it (rotary position embeddings): those columns form planes,
and the pair's symmetry is complex scalars on the planes ("rotary", "rotary-interleaved")
times ``GL`` on the columns left alone (partial rotary), split into two pairs.

**What is not a symmetry.** Features that pass through anything but data movement,
sums and scalings (a normalisation, a clamp) before their core are *tainted*: their
pair does not exist, and the reason is kept. A pair whose features are tainted
anywhere, or whose layout is not one of the above, is dropped with its reason; nothing
is guessed. Every pair kept is then verified numerically
(:mod:`geosharp.symmetry.verify`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from .pairs import Block, Dropped, PairSpec
from .trace import PARAM_BASE, Consumption, Core, Mixing, Side, Trace

__all__ = ["Assembly", "assemble"]

_I64 = torch.int64


class _NotPair(Exception):
    """A structure that is not (or not understood as) a pair; ``exact``: not a symmetry."""

    def __init__(self, reason: str, exact: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.exact = exact


@dataclass
class _Node:
    """The columns of one operand slice: ``own[c]`` the feature of column ``c``,
    ``partner[c]`` the column rotated with it (-1: none), ``biases`` the positions of
    parameters added, per parameter index, per column."""

    own: Tensor
    source: int
    partner: tuple[int, ...]
    biases: dict[int, Tensor] = field(default_factory=dict)
    key: bytes = b""

    def __post_init__(self) -> None:
        self.key = self.own.numpy().tobytes()


@dataclass
class _ParamNode:
    """A weight slice that reads a head's features linearly (Funnel's token-type
    embeddings meet the queries like keys): its entries ``base + rows[r] + cols[c]``
    are rows of the head's opposite side."""

    param: str
    base: int
    rows: Tensor
    cols: Tensor
    partner = None
    biases: dict = field(default_factory=dict)

    @property
    def key(self) -> bytes:
        return f"{self.param}|{self.base}|{self.cols.tolist()}".encode()


@dataclass
class Assembly:
    """Pairs found in a trace, the attention modules (by the module that computed their
    scores) and, per attention module, the pairs dropped with their reasons; ``ran``:
    the modules whose forward ran, ``opaque``: ``(module, op)`` where features entered
    an op the trace cannot look into; ``uses``: per parameter, the modules that used it;
    ``unknown``: ``(module, reason, params)`` per op the trace cannot look into, with
    the parameters whose projection features entered it."""

    pairs: list[PairSpec]
    attention: list[str]
    dropped: list[Dropped]
    ran: set[str] = field(default_factory=set)
    opaque: list[tuple[str, str]] = field(default_factory=list)
    uses: dict[str, set[str]] = field(default_factory=dict)
    unknown: list[tuple[str, str, frozenset[str]]] = field(default_factory=list)


def assemble(trace: Trace, names_of_modules: list[str]) -> Assembly:
    """Turn ``trace``'s events into pairs (see the module docstring)."""
    builder = _Builder(trace, names_of_modules)
    return builder.run()


class _Builder:
    def __init__(self, trace: Trace, modules: list[str]):
        self.trace = trace
        self.modules = set(modules)
        self.bases = torch.tensor([s.base for s in trace.sources] or [1], dtype=_I64)
        self.taints = _TaintIndex(trace.taints)

    # -- nodes -----------------------------------------------------------------------------

    def source_of(self, ids: Tensor) -> Tensor:
        return torch.searchsorted(self.bases, ids.contiguous(), right=True) - 1

    def nodes(self, side: Side, what: str) -> list[_Node]:
        """The distinct nodes of an operand, in slice order."""
        if side.taint is not None:
            raise _NotPair(f"{what} {_reason(side.taint.reason)}", exact=side.taint.certain)
        ids = side.ids
        own = ids[..., 0]
        if bool(((own <= 0) | (own >= PARAM_BASE)).any()):
            raise _NotPair(f"{what} have a column that holds no projection feature")
        _, first = _unique_rows(own)
        return self._nodes(ids[first])

    def _nodes(self, ids: Tensor) -> list[_Node]:
        """The nodes of distinct slices ``ids`` (``(n, columns, slots)``), all at once."""
        own = ids[..., 0].contiguous()
        n, columns = own.shape
        src = self.source_of(own)
        if not bool((src == src[:, :1]).all()):
            raise _NotPair("a head's columns come from different projections")
        ordered, order = torch.sort(own, dim=1)
        if columns > 1 and bool((ordered[:, 1:] == ordered[:, :-1]).any()):
            raise _NotPair("a head holds one feature in two columns")
        partner = torch.full((n, columns), -1, dtype=_I64)
        biases: dict[int, Tensor] = {}  # parameter -> positions (n, columns)
        for k in range(1, ids.shape[2]):
            slot = ids[:, :, k].contiguous()
            nonzero = slot != 0
            if not bool(nonzero.any()):
                continue
            is_param = slot >= PARAM_BASE
            is_feat = nonzero & ~is_param
            if bool(is_feat.any()):
                at = torch.searchsorted(ordered, slot).clamp_max(columns - 1)
                if not bool((ordered.gather(1, at) == slot)[is_feat].all()):
                    raise _NotPair("a column mixes features of different heads or projections")
                cols = order.gather(1, at)
                if bool((is_feat & (partner >= 0) & (partner != cols)).any()):
                    raise _NotPair("a column mixes features of different heads or projections")
                partner = torch.where(is_feat, cols, partner)
            if bool(is_param.any()):
                params = (slot[is_param] // PARAM_BASE - 1).unique()
                if len(params) != 1:
                    raise _NotPair("parameters are added to different columns of a head")
                p, positions = int(params[0]), slot % PARAM_BASE
                if p in biases:
                    # a bias added before a rotation: on the rotated columns, the entries
                    # of their partners, rotated along
                    rotated = partner >= 0
                    expected = biases[p].gather(1, partner.clamp_min(0))
                    if not torch.equal(is_param, rotated) or not torch.equal(
                        positions[rotated], expected[rotated]
                    ):
                        raise _NotPair("one parameter is added twice to a head")
                    continue
                if not bool(is_param.all()):
                    raise _NotPair("a parameter is added to some columns of a head only")
                biases[p] = positions
        rotated = partner >= 0
        back = partner.clamp_min(0).gather(1, partner.clamp_min(0))
        if bool((rotated & (back != torch.arange(columns))).any()):
            raise _NotPair("columns are mixed, but not in rotation planes")
        partners = [tuple(row) for row in partner.tolist()]
        sources = src[:, 0].tolist()
        return [
            _Node(own[i], sources[i], partners[i], {p: pos[i] for p, pos in biases.items()})
            for i in range(n)
        ]

    # -- query/key -------------------------------------------------------------------------

    def run(self) -> Assembly:
        pairs: list[PairSpec] = []
        dropped: list[Dropped] = []
        attention: list[str] = []
        qk = self.query_key()
        vo = self.value_output()  # the modules whose scores mix values: attention
        for module in dict.fromkeys([*qk, *vo]):
            is_attention = module in vo
            comps_qk = qk.get(module, ([], None))
            comps_vo = vo.get(module, ([], None))
            if is_attention and module not in qk:
                reason = "its scores are not a product of projections the trace can follow"
                comps_qk = ([], _NotPair(reason))
            specs_qk, specs_vo = [], []
            drops = []
            for kind, (comps, failure), out in (
                ("query-key", comps_qk, specs_qk),
                ("value-output", comps_vo, specs_vo),
            ):
                if failure is not None:
                    drops.append((kind, failure))
                    continue
                try:
                    out.extend(self.stack(module, kind, comps))
                except _NotPair as err:
                    drops.append((kind, err))
            unit = _common_module([p for spec in specs_qk + specs_vo for p in spec.params])
            name = unit if unit is not None else module
            for spec in specs_qk + specs_vo:
                pairs.append(_renamed(spec, name))
            if not is_attention:  # a product of projections outside attention
                continue
            attention.append(name)
            for kind, err in drops:
                dropped.append(Dropped(name, kind, err.reason, err.exact))
        return Assembly(
            pairs, list(dict.fromkeys(attention)), dropped, set(self.trace.ran),
            list(self.trace.opaque), dict(self.trace.uses), self.unknown(),
        )  # fmt: skip

    def unknown(self) -> list[tuple[str, str, frozenset[str]]]:
        """The ops the trace could not look into, with the parameters whose features
        entered each (every projection a run of feature ids overlaps)."""
        out = []
        for runs, reason, module in self.trace.unknown:
            lo = self.source_of(runs[:, 0]).tolist()
            hi = self.source_of(runs[:, 1] - 1).tolist()
            params = frozenset(
                self.trace.sources[i].param for a, b in zip(lo, hi) for i in range(a, b + 1)
            )
            out.append((module, reason, params))
        return out

    def query_key(self) -> dict[str, tuple[list, _NotPair | None]]:
        """Per attention module, its query/key components (or why there are none)."""
        graph = _Graph()
        failures: dict[str, _NotPair] = {}
        order: list[str] = []
        for core in self.trace.cores:
            if core.module not in order:
                order.append(core.module)
            if core.module in failures:
                continue
            try:
                self._core(core, graph)
            except _NotPair as err:
                failures[core.module] = err
        self._readers(graph)
        comps: dict[str, list] = defaultdict(list)
        for comp in graph.components():
            if comp.module not in failures:
                comps[comp.module].append(comp)
        out = {}
        for module in order:
            if module in failures:
                out[module] = ([], failures[module])
                continue
            try:
                self._check_taint(comps[module], "queries and keys")
                out[module] = (comps[module], None)
            except _NotPair as err:
                out[module] = ([], err)
        return out

    def _readers(self, graph: _Graph) -> None:
        """Weights that read a query or key head's features join the opposite side."""
        for cons in self.trace.consumptions:
            ids = cons.feat.ids
            if cons.mix is not None or ids is None:
                continue
            slices = cons.slice_offsets()
            for l in range(ids.shape[0]):
                key = ids[l, :, 0].numpy().tobytes()
                if key not in graph.nodes:
                    continue
                node = self._nodes(ids[l : l + 1])[0]
                reader = _ParamNode(
                    cons.weight.param,
                    cons.weight.offset + int(slices[l % len(slices)]),
                    cons.row_offsets(),
                    cons.col_offsets(torch.arange(ids.shape[1])),
                )
                graph.edge(node, reader, graph.module[key], core=False)

    def _core(self, core: Core, graph: _Graph) -> None:
        left = core.left
        right = core.right
        if left.taint is not None or right.taint is not None:
            side, what = (left, "queries") if left.taint is not None else (right, "keys")
            raise _NotPair(f"{what} {_reason(side.taint.reason)}", exact=side.taint.certain)
        lids, rids = left.ids, right.ids
        if lids.shape[:2] != rids.shape[:2]:
            raise _NotPair("the two operands of the scores have different slices")
        lnodes = self._slice_nodes(lids, "queries")
        rnodes = self._slice_nodes(rids, "keys")
        for a, b in zip(lnodes, rnodes):
            graph.edge(a, b, core.module)

    def _slice_nodes(self, ids: Tensor, what: str) -> list[_Node]:
        """The node of every slice (nodes shared between slices are one object)."""
        own = ids[..., 0]
        if bool(((own <= 0) | (own >= PARAM_BASE)).any()):
            raise _NotPair(f"{what} have a column that holds no projection feature")
        unique, inverse = torch.unique(own, dim=0, return_inverse=True)
        first = torch.full((len(unique),), own.shape[0], dtype=_I64)
        first.scatter_reduce_(0, inverse, torch.arange(own.shape[0]), reduce="amin")
        nodes = self._nodes(ids[first])
        return [nodes[i] for i in inverse.tolist()]

    # -- value/output ----------------------------------------------------------------------

    def value_output(self) -> dict[str, tuple[list, _NotPair | None]]:
        by_mix: dict[int, list[Consumption]] = defaultdict(list)
        for c in self.trace.consumptions:
            if c.mix is not None:
                by_mix[c.mix].append(c)
        out: dict[str, tuple[list, _NotPair | None]] = {}
        for mixing in self.trace.mixings:
            if not mixing.by_scores:
                continue
            module = mixing.module
            if module in out and out[module][1] is not None:
                continue
            if mixing.taint is not None:
                reason = f"values {_reason(mixing.taint.reason)}"
                out[module] = ([], _NotPair(reason, mixing.taint.certain))
                continue
            if mixing.ids is None:
                if module not in out:
                    reason = "its values are not projected: there is no value/output pair"
                    out[module] = ([], _NotPair(reason, exact=True))
                continue
            try:
                comps = self._value_output(mixing, by_mix.get(mixing.index, []))
                previous = out.get(module, ([], None))[0]
                seen = {c.node.key for c in previous}
                out[module] = (previous + [c for c in comps if c.node.key not in seen], None)
            except _NotPair as err:
                out[module] = ([], err)
        return out

    def _value_output(self, mixing: Mixing, consumers: list[Consumption]) -> list:
        nodes = self.nodes(Side(ids=mixing.ids), "values")
        if not consumers:
            reason = self.taints.reason(torch.cat([n.own for n in nodes]))
            if reason is not None:
                raise _NotPair(f"the attention output {_reason(reason[0])}", reason[1])
            raise _NotPair("the attention output reaches no projection", exact=True)
        known = torch.cat([n.own for n in nodes])
        params = {p for n in nodes for p in n.biases}
        reads = []  # per consumer: its input columns sorted by the feature they read
        for consumer in consumers:
            ids = consumer.feat.ids
            if ids is None or ids.shape[0] != 1:
                raise _NotPair("the attention output is read per slice by a weight")
            own = ids[0, :, 0]
            extra = ids[0, :, 1:]
            feats = extra[(extra > 0) & (extra < PARAM_BASE)]
            entries = extra[extra >= PARAM_BASE] // PARAM_BASE - 1
            if not bool(torch.isin(feats, known).all()) or not set(entries.tolist()) <= params:
                raise _NotPair(
                    "the attention output is combined with other terms before its projection"
                )
            order = torch.argsort(own, stable=True)
            reads.append((consumer, own[order], order))
        comps = []
        for node in nodes:
            columns = []
            for consumer, ordered, order in reads:
                lo = torch.searchsorted(ordered, node.own.contiguous())
                hi = torch.searchsorted(ordered, node.own.contiguous(), right=True)
                count = hi - lo
                if not bool((count == count[0]).all()):
                    raise _NotPair("value features are read by different numbers of output columns")
                if int(count[0]) == 0:
                    continue
                # (stack, h): the s-th column reading each feature, in column order
                cols = order[lo[None, :] + torch.arange(int(count[0]))[:, None]]
                columns.append((consumer, cols))
            if not columns:
                raise _NotPair("a value feature reaches no output projection")
            comps.append(_ValueComponent(mixing.module, node, columns))
        self._check_taint(comps, "values")
        return comps

    # -- taints ----------------------------------------------------------------------------

    def _check_taint(self, comps: list, what: str) -> None:
        """Raise if a feature of ``comps`` is tainted anywhere (also after its core)."""
        if not comps:
            return
        features = torch.cat([n.own for comp in comps for n in comp.all_nodes()])
        found = self.taints.reason(features)
        if found is not None:
            raise _NotPair(f"{what} also {_reason(found[0])}", exact=found[1])

    # -- blocks ----------------------------------------------------------------------------

    def stack(self, module: str, kind: str, comps: list) -> list[PairSpec]:
        """Components of one module and kind, stacked as heads where their layouts agree
        (one :class:`PairSpec` per layout), split into rotary and pass-through parts."""
        groups: dict[tuple, list] = defaultdict(list)
        for comp in comps:
            groups[comp.signature(self)].append(comp)
        out = []
        for comps_of in groups.values():
            out.extend(self._specs(module, kind, comps_of))
        return out

    def _specs(self, module: str, kind: str, comps: list) -> list[PairSpec]:
        first = comps[0]
        partner = first.partner()
        h = len(partner)
        rotated = [c for c in range(h) if partner[c] >= 0]
        passed = [c for c in range(h) if partner[c] < 0]
        parts: list[tuple[str, list[int], str]] = []
        if rotated:
            group, order = _plane_layout(partner, rotated)
            parts.append((kind, order, group))
            if passed:
                parts.append((f"{kind}-pass", passed, "GL"))
        else:
            parts.append((kind, list(range(h)), "GL"))
        stack = first.stack_size()
        note = ""
        if stack > 1:
            note = f"{stack} query heads share each key/value head"
        specs = []
        for part_kind, columns, group in parts:
            cols = torch.tensor(columns, dtype=_I64)
            g = tuple(self._blocks(comps, "g", cols))
            hb = tuple(self._blocks(comps, "h", cols))
            specs.append(
                PairSpec(module, part_kind, g, hb, group=group, note=note, query_heads=stack)
            )
        return specs

    def _blocks(self, comps: list, side: str, cols: Tensor) -> list[Block]:
        """The blocks of one side of stacked components: per row kind (weight rows,
        bias, added parameters, or a consuming weight's columns), one block whose rows
        stack the side's nodes."""
        return comps[0].blocks(self, comps, side, cols)

    def weight_block(self, nodes_per_head: list[list[_Node]], cols: Tensor) -> Block:
        source = self.trace.sources[nodes_per_head[0][0].source]
        feats = _owns(nodes_per_head)[:, :, cols] - source.base  # (heads, stacked, h)
        offsets = source.offset + source.feature_offsets(feats)
        rows = _axes_offsets(source.rows)
        return _block(source.param, offsets, rows)

    def bias_block(self, nodes_per_head: list[list[_Node]], cols: Tensor) -> Block | None:
        source = self.trace.sources[nodes_per_head[0][0].source]
        if source.bias is None:
            return None
        feats = _owns(nodes_per_head)[:, :, cols] - source.base
        bias = source.bias
        positions = bias.offset + _flat_offsets(bias.shape, bias.strides, feats)
        return _block(bias.param, positions, torch.zeros(1, dtype=_I64))

    def added_blocks(self, nodes_per_head: list[list[_Node]], cols: Tensor) -> list[Block]:
        keys = sorted(nodes_per_head[0][0].biases)
        out = []
        for p in keys:
            positions = torch.stack(
                [torch.stack([n.biases[p][cols] for n in nodes]) for nodes in nodes_per_head]
            )
            out.append(_block(self.trace.params[p], positions, torch.zeros(1, dtype=_I64)))
        return out


# --- components -----------------------------------------------------------------------------


class _QueryKeyComponent:
    """Nodes of one bilinear form: ``g`` (the side of the first query operand) and
    ``h``."""

    def __init__(self, module: str, g: list[_Node], h: list[_Node]):
        self.module = module
        self.g, self.h = g, h

    def all_nodes(self) -> list[_Node]:
        return [n for n in self.g + self.h if isinstance(n, _Node)]

    def partner(self) -> tuple[int, ...]:
        return self.all_nodes()[0].partner

    def stack_size(self) -> int:
        return len(self.g) if len(self.h) == 1 else 1

    def signature(self, builder: _Builder) -> tuple:
        def side(nodes):
            return tuple(
                (n.source, n.partner, tuple(sorted(n.biases)))
                if isinstance(n, _Node)
                else (n.param, len(n.rows))
                for n in nodes
            )

        partners = {n.partner for n in self.all_nodes()}
        if len(partners) != 1:
            raise _NotPair("queries and keys are rotated in different planes")
        return ("qk", side(self.g), side(self.h))

    def blocks(self, builder: _Builder, comps: list, side: str, cols: Tensor) -> list[Block]:
        per_head = [c.g if side == "g" else c.h for c in comps]
        return _node_blocks(builder, per_head, cols)


class _ValueComponent:
    """A value head (``node``) and, per consuming weight, its input columns ``(stack,
    h)`` that read the head's features: ``H`` stacks one block of columns per reading
    query head."""

    def __init__(self, module: str, node: _Node, reads: list[tuple[Consumption, Tensor]]):
        self.module = module
        self.node = node
        self.reads = reads

    def all_nodes(self) -> list[_Node]:
        return [self.node]

    def partner(self) -> tuple[int, ...]:
        return self.node.partner

    def stack_size(self) -> int:
        return self.reads[0][1].shape[0]

    def signature(self, builder: _Builder) -> tuple:
        readers = tuple((c.weight.param, cols.shape[0]) for c, cols in self.reads)
        return ("vo", self.node.source, self.node.partner, tuple(sorted(self.node.biases)), readers)

    def blocks(self, builder: _Builder, comps: list, side: str, cols: Tensor) -> list[Block]:
        if side == "g":
            return _node_blocks(builder, [[c.node] for c in comps], cols)
        out = []
        for i, (consumer, _) in enumerate(comps[0].reads):
            offsets = torch.stack([consumer.col_offsets(c.reads[i][1][:, cols]) for c in comps])
            out.append(
                _block(
                    consumer.weight.param, offsets + consumer.weight.offset, consumer.row_offsets()
                )
            )
        return out


def _owns(nodes_per_head: list[list[_Node]]) -> Tensor:
    """The features of stacked nodes, ``(heads, stacked, columns)``."""
    flat = torch.stack([n.own for nodes in nodes_per_head for n in nodes])
    return flat.view(len(nodes_per_head), len(nodes_per_head[0]), -1)


def _node_blocks(builder: _Builder, per_head: list[list], cols: Tensor) -> list[Block]:
    """Weight rows of the stacked nodes, then their biases, then added parameters, then
    weights that read them; consecutive nodes of one projection share a block."""
    first = per_head[0]
    features = [i for i, n in enumerate(first) if isinstance(n, _Node)]
    readers = [i for i, n in enumerate(first) if isinstance(n, _ParamNode)]
    weights, biases, added = [], [], []
    if features:
        for a, b in _runs([first[i].source for i in features], features):
            run = [nodes[a:b] for nodes in per_head]
            weights.append(builder.weight_block(run, cols))
            bias = builder.bias_block(run, cols)
            if bias is not None:
                biases.append(bias)
            added.extend(builder.added_blocks(run, cols))
    for i in readers:
        nodes = [heads[i] for heads in per_head]
        heads_cols = torch.stack([(n.base + n.cols[cols])[None, :] for n in nodes])
        added.append(_block(nodes[0].param, heads_cols, nodes[0].rows))
    return weights + biases + added


def _runs(sources: list[int], index: list[int]) -> list[tuple[int, int]]:
    """``(start, stop)`` of consecutive positions (``index``) with one source."""
    runs = []
    start = 0
    for j in range(1, len(index) + 1):
        if j == len(index) or sources[j] != sources[start] or index[j] != index[j - 1] + 1:
            runs.append((index[start], index[j - 1] + 1))
            start = j
    return runs


# --- graph ------------------------------------------------------------------------------


class _Graph:
    """Nodes joined by the cores they meet in, with a two-colouring."""

    def __init__(self):
        self.nodes: dict[bytes, _Node] = {}
        self.module: dict[bytes, str] = {}
        self.adj: dict[bytes, list[bytes]] = defaultdict(list)
        self.order: list[bytes] = []
        self.position: dict[bytes, int] = {}
        self.first_left: set[bytes] = set()

    def edge(self, a, b, module: str, core: bool = True) -> None:
        for n in (a, b):
            if n.key not in self.nodes:
                self.nodes[n.key] = n
                self.module[n.key] = module
                self.position[n.key] = len(self.order)
                self.order.append(n.key)
            elif isinstance(n, _Node):
                _merge(self.nodes[n.key], n)
        if a.key == b.key:
            raise _NotPair("a projection meets itself in the scores")
        if b.key not in self.adj[a.key]:
            self.adj[a.key].append(b.key)
            self.adj[b.key].append(a.key)
        if core:
            self.first_left.add(a.key)

    def components(self) -> list[_QueryKeyComponent]:
        colour: dict[bytes, int] = {}
        out = []
        for start in self.order:
            if start in colour:
                continue
            first = 0 if start in self.first_left else 1
            colour[start] = first
            members, queue = [start], [start]
            while queue:
                k = queue.pop()
                for n in self.adj[k]:
                    if n not in colour:
                        colour[n] = 1 - colour[k]
                        members.append(n)
                        queue.append(n)
                    elif colour[n] == colour[k]:
                        raise _NotPair("queries meet queries in the scores (no two sides)")
            members.sort(key=self.position.__getitem__)
            g = [self.nodes[k] for k in members if colour[k] == first]
            h = [self.nodes[k] for k in members if colour[k] != first]
            out.append(_QueryKeyComponent(self.module[start], g, h))
        return out


def _merge(kept: _Node, seen: _Node) -> None:
    """One head met in several scores, with different parameters added (Funnel's
    content and position biases): all of them are rows of its side."""
    if kept.partner != seen.partner:
        raise _NotPair("a head is rotated differently in different scores")
    for p, positions in seen.biases.items():
        if p in kept.biases and not torch.equal(kept.biases[p], positions):
            raise _NotPair("a head is added different entries of one parameter")
        kept.biases.setdefault(p, positions)


# --- helpers ----------------------------------------------------------------------------


class _TaintIndex:
    """Which features were tainted, by which reason first (runs of feature ids)."""

    def __init__(self, taints):
        if taints:
            runs = torch.cat([t[0] for t in taints])
            event = torch.cat([torch.full((len(t[0]),), i) for i, t in enumerate(taints)])
            order = torch.argsort(runs[:, 0], stable=True)
            self.starts, self.stops = runs[order, 0].contiguous(), runs[order, 1]
            self.event = event[order]
            # the longest run reaching each position, to test containment by one search
            self.reach = torch.cummax(self.stops, 0).values
        else:
            self.starts = self.stops = self.event = self.reach = torch.zeros(0, dtype=_I64)
        self.taints = taints

    def reason(self, features: Tensor) -> tuple[str, bool] | None:
        """The first reason that tainted one of ``features``, if any."""
        if not len(self.starts):
            return None
        pos = torch.searchsorted(self.starts, features.contiguous(), right=True) - 1
        hit = (pos >= 0) & (self.reach[pos.clamp_min(0)] > features)
        if not bool(hit.any()):
            return None
        first = None
        for f in features[hit].tolist():  # the events containing them (few)
            inside = (self.starts <= f) & (self.stops > f)
            i = int(self.event[inside].min())
            first = i if first is None else min(first, i)
        _, reason, certain, _ = self.taints[first]
        return reason, certain


def _reason(text: str) -> str:
    return f"pass through {text}" if text else "are not linear in their projection"


def _unique_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Distinct rows of ``x`` and the index of each one's first occurrence (in order)."""
    unique, inverse = torch.unique(x, dim=0, return_inverse=True)
    first = torch.full((len(unique),), x.shape[0], dtype=_I64)
    first.scatter_reduce_(0, inverse, torch.arange(x.shape[0]), reduce="amin")
    order = torch.argsort(first)
    return unique[order], first[order]


def _plane_layout(partner: tuple[int, ...], rotated: list[int]) -> tuple[str, list[int]]:
    """The rotary group and column order of the rotated columns: planes ``(j, j + r/2)``
    or ``(2j, 2j + 1)`` of the rotated columns as they stand, else reordered so."""
    r = len(rotated)
    if r % 2:
        raise _NotPair("an odd number of rotated columns")
    firsts = [c for c in rotated if c < partner[c]]
    if all(partner[rotated[j]] == rotated[j + r // 2] for j in range(r // 2)):
        return "rotary", rotated
    if all(partner[rotated[2 * j]] == rotated[2 * j + 1] for j in range(r // 2)):
        return "rotary-interleaved", rotated
    return "rotary", firsts + [partner[c] for c in firsts]


def _axes_offsets(axes: tuple[tuple[int, int], ...]) -> Tensor:
    """Offsets of the flat (row-major) index over ``axes`` ``(size, stride)``."""
    out = torch.zeros(1, dtype=_I64)
    for size, stride in axes:
        out = (out[:, None] + torch.arange(size, dtype=_I64)[None, :] * stride).reshape(-1)
    return out


def _flat_offsets(shape: tuple[int, ...], strides: tuple[int, ...], flat: Tensor) -> Tensor:
    out = torch.zeros_like(flat)
    rest = flat.clone()
    for size, stride in reversed(list(zip(shape, strides))):
        out += (rest % size) * stride
        rest //= size
    return out


def _block(param: str, heads_cols: Tensor, rows: Tensor) -> Block:
    """Block ``index[k, (s, r), c] = heads_cols[k, s, c] + rows[r]``: separable when
    ``heads_cols`` is, else listed."""
    k, _, c = heads_cols.shape
    origin = heads_cols[0, 0, 0]
    hk = heads_cols[:, 0, 0]
    hs = heads_cols[0, :, 0] - origin
    hc = heads_cols[0, 0, :] - origin
    rebuilt = hk[:, None, None] + hs[None, :, None] + hc[None, None, :]
    if torch.equal(rebuilt, heads_cols):
        row_index = (hs[:, None] + rows[None, :]).reshape(-1)
        return Block.separable(param, hk, row_index, hc)
    index = (heads_cols[:, :, None, :] + rows[None, None, :, None]).reshape(k, -1, c)
    return Block(param, index)


def _common_module(params: list[str]) -> str | None:
    """The smallest module that holds all ``params`` (``None`` without any)."""
    if not params:
        return None
    parts = [p.split(".")[:-1] for p in params]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _renamed(spec: PairSpec, module: str) -> PairSpec:
    return replace(spec, module=module)
