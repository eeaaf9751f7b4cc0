r"""From a traced forward pass (:mod:`geosharp.symmetry.trace`) to pairs.

**Nodes.** A core contracts two operands over their features, slice by slice (one slice
per head, per batch element). The columns of one slice of one operand are a *node*: per
column, the features it holds, one of each projection summed there (a weight and the
adapter added to it), the column rotated with it (rotary embeddings), and the rows of
parameters added to it (a bias, the rows of a table looked up, memory tokens). Columns
whose features come from different projections on either side (multi-head latent
attention: the keys' rotary part from another projection) are parts of their own.

**Query/key.** A node and the node it meets are the two sides of one bilinear form, so
the symmetry ``(G, H) -> (G A, H A^{-T})`` must act on both with one ``A``: nodes are
joined into components by the cores they meet in (grouped-query heads: one key node
meets several query nodes; DeBERTa: queries and keys also meet the other side's
position projections; a block shared across depth: its nodes of every call hold the
same projection), and each component, two-coloured, is one pair, ``G`` stacking the
rows of one side's nodes and ``H`` the other's. A node's rows are its projections'
weight rows (one per input), their biases and any parameter added to it later. A core
whose scores mix no values (a scan, a mixture-of-experts combine) gives a pair of kind
``"product"`` the same way.

**Value/output.** Scores mix features over tokens, slice by slice; the features mixed
in one slice (a value head) stay in their columns until a weight consumes them (the
output projection). The value head's rows form ``G``; the weight's columns that read
each of its features form ``H`` (stacked when several query heads read one value
head).

**Groups.** A column whose element is its own feature plus a partner feature of the
same node is rotated with it (rotary position embeddings): those columns form planes,
and the pair's symmetry is complex scalars on the planes ("rotary",
"rotary-interleaved") times ``GL`` on the columns left alone (partial rotary), split
into two pairs.

**Candidates.** Features that went through an op that is not linear before or after
their core (a normalisation, an activation, a clamp) make their pair a candidate that
its verification decides, group by group (:attr:`Assembly.tainted`); features that
lost their ids on the way (a sum with an activation) leave no pair, with the reason.
Every pair kept is then verified numerically (:mod:`geosharp.symmetry.verify`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from .pairs import Block, Dropped, PairSpec
from .trace import PARAM_BASE, Consumption, Core, Mixing, Side, Taint, Trace

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
    """The columns of one operand slice: ``own[k, c]`` the feature of projection
    ``sources[k]`` in column ``c``, ``partner[c]`` the column rotated with it (-1: none),
    ``biases`` the positions ``(rows, columns)`` of parameters added, per parameter
    index; ``taint``: the op that is not linear its features went through."""

    own: Tensor
    sources: tuple[int, ...]
    partner: tuple[int, ...]
    biases: dict[int, Tensor] = field(default_factory=dict)
    taint: Taint | None = None
    key: bytes = b""

    def __post_init__(self) -> None:
        self.key = self.own.numpy().tobytes()

    @property
    def features(self) -> Tensor:
        return self.own.reshape(-1)


@dataclass
class _ParamNode:
    """A weight slice that reads a head's features linearly (Funnel's token-type
    embeddings meet the queries like keys): its entries ``base + rows[r] + cols[c]``
    are rows of the head's opposite side."""

    param: str
    base: int
    rows: Tensor
    cols: Tensor
    source: int = -1  # the projection it makes: its outputs are terms of the scores
    partner = None
    taint = None
    biases: dict = field(default_factory=dict)

    @property
    def key(self) -> bytes:
        return f"{self.param}|{self.base}|{self.cols.tolist()}".encode()


@dataclass
class Assembly:
    """Pairs found in a trace, the attention modules (by the module that computed their
    scores) and, per module, the pairs dropped with their reasons; ``ran``: the modules
    whose forward ran, ``opaque``: ``(module, op)`` where features entered an op the
    trace cannot look into; ``uses``: per parameter, the modules that used it;
    ``unknown``: ``(module, reason, params, features, matrices)`` per op whose effect
    the trace cannot read, with the parameters whose projection features
    (``features``: their ids, as runs) or weight matrices (``matrices``) entered it.
    ``tainted``: per pair name, why its features are not linear, and whether that is
    certain (the pair is a candidate whose group verification finds, unless no
    continuous symmetry survives their ops, the third); ``features``: per pair name,
    the runs of feature ids its nodes hold."""

    pairs: list[PairSpec]
    attention: list[str]
    dropped: list[Dropped]
    ran: set[str] = field(default_factory=set)
    opaque: list[tuple[str, str]] = field(default_factory=list)
    uses: dict[str, set[str]] = field(default_factory=dict)
    unknown: list[tuple[str, str, frozenset[str], Tensor, frozenset[str]]] = field(
        default_factory=list
    )
    tainted: dict[str, tuple[str, bool, bool]] = field(default_factory=dict)
    features: dict[str, Tensor] = field(default_factory=dict)


def assemble(trace: Trace, names_of_modules: list[str]) -> Assembly:
    """Turn ``trace``'s events into pairs (see the module docstring)."""
    return _Builder(trace, names_of_modules).run()


class _Builder:
    def __init__(self, trace: Trace, modules: list[str]):
        self.trace = trace
        self.modules = set(modules)
        self.bases = torch.tensor([s.base for s in trace.sources] or [1], dtype=_I64)
        self.taints = _TaintIndex(trace.taints)
        self.attention_cores = frozenset().union(*(m.cores for m in trace.mixings if m.by_scores))

    # -- nodes -----------------------------------------------------------------------------

    def source_of(self, ids: Tensor) -> Tensor:
        return torch.searchsorted(self.bases, ids.contiguous(), right=True) - 1

    def column_groups(self, sides: list[Side]) -> list[Tensor]:
        """The columns of the sides' slices grouped by the projections they hold on every
        side (in column order)."""
        signature = []
        for side in sides:
            ids = side.ids[0]  # (tokens, columns, slots)
            feats = (ids > 0) & (ids < PARAM_BASE)
            src = torch.where(feats, self.source_of(ids), torch.full_like(ids, -1))
            present = src[src >= 0]
            if not len(present) or bool((present == present[0]).all()):  # one projection
                signature.append([()] * ids.shape[1])
                continue
            signature.append([tuple(sorted(set(src[:, c].reshape(-1).tolist()) - {-1}))
                              for c in range(ids.shape[1])])  # fmt: skip
        keys = list(zip(*signature))
        groups: dict[tuple, list[int]] = {}
        for c, key in enumerate(keys):
            groups.setdefault(key, []).append(c)
        return [torch.tensor(cols, dtype=_I64) for cols in groups.values()]

    def slice_nodes(self, side: Side, cols: Tensor, what: str) -> list[_Node]:
        """The node of every slice of ``side`` on columns ``cols`` (slices holding the
        same features share one node)."""
        if side.ids is None:
            taint = side.taint
            raise _NotPair(f"{what} {_reason(taint.reason)}", exact=taint.certain)
        ids = side.ids[:, :, cols, :]
        if bool((ids < 0).any()):
            raise _NotPair(f"{what} hold an activation or a constant that no projection made")
        feats = (ids > 0) & (ids < PARAM_BASE)
        token_has = feats[..., 0]  # (slices, tokens, columns): slot 0 holds a feature
        full = token_has.all(-1)
        empty = ~feats.any(-1).any(-1)
        zero = ~(ids != 0).flatten(1).any(1)  # a slice of zeros (padding): no node
        if bool(zero.all()):
            raise _NotPair(f"{what} hold no projection feature")
        if bool((~full & ~empty).any()) or not bool((full.any(1) | zero).all()):
            raise _NotPair(f"{what} have a column that holds no projection feature")
        if bool(zero.any()):
            kept = torch.nonzero(~zero).flatten()
            nodes = self.slice_nodes(Side(side.ids[kept], side.taint), cols, what)
            out: list[_Node | None] = [None] * len(ids)
            for i, node in zip(kept.tolist(), nodes):
                out[i] = node
            return out
        first = full.to(torch.int8).argmax(1)  # a token with features, per slice
        reference = torch.where(feats, ids, torch.zeros_like(ids))
        ref = reference[torch.arange(len(ids)), first]  # (slices, columns, slots)
        same = (reference == ref[:, None]) | ~full[..., None, None]
        if not bool(same.all()):
            raise _NotPair(f"{what} hold different features at different tokens")
        unique, inverse = torch.unique(ref.reshape(len(ref), -1), dim=0, return_inverse=True)
        first = torch.full((len(unique),), len(ref), dtype=_I64)
        first.scatter_reduce_(0, inverse, torch.arange(len(ref)), reduce="amin")
        refs = ref[first]  # (nodes, columns, slots)
        with_params = torch.zeros(len(unique), dtype=torch.bool)
        with_params.scatter_reduce_(0, inverse, (ids >= PARAM_BASE).flatten(1).any(1), "amax")
        src = torch.where(refs > 0, self.source_of(refs), torch.full_like(refs, -1))
        one = src.amax((1, 2))  # a node of one projection (most): all its nodes at once
        single = ((src == one[:, None, None]) | (src < 0)).all((1, 2))
        own_one, partner_one = (
            _own_and_partner(refs[single]) if bool(single.any()) else (None, None)
        )
        at_single = torch.cumsum(single.to(_I64), 0) - 1
        order = torch.argsort(inverse, stable=True)
        groups = torch.split(order, torch.bincount(inverse, minlength=len(unique)).tolist())
        nodes = []
        for u in range(len(unique)):
            if not bool(single[u]):
                nodes.append(self.node(refs[u], ids[groups[u]], side.taint))
                continue
            j = int(at_single[u])
            own, partner = own_one[j : j + 1], partner_one[j]
            biases = self.added(ids[groups[u]], partner, own[0]) if bool(with_params[u]) else {}
            nodes.append(_Node(own, (int(one[u]),), tuple(partner.tolist()), biases, side.taint))
        return [nodes[i] for i in inverse.tolist()]

    def node(self, ref: Tensor, ids: Tensor, taint: Taint | None) -> _Node:
        """The node of reference features ``ref[c, s]`` whose slices hold ``ids`` (every
        slice, token, column and slot: parameter entries among them), of several
        projections summed in its columns."""
        columns = ref.shape[0]
        src = torch.where(ref > 0, self.source_of(ref), torch.full_like(ref, -1))
        every = src[src >= 0].unique()
        held = (src[:, :, None] == every).any(1)  # (columns, sources): held by the column
        if not bool(held.all()):
            raise _NotPair("a head's columns come from different projections")
        order = [int(s) for s in dict.fromkeys(src[:, 0].tolist())]
        sources = tuple(order + sorted(set(every.tolist()) - set(order)))
        own = torch.zeros(len(sources), columns, dtype=_I64)
        partner = torch.full((columns,), -1, dtype=_I64)
        for k, source in enumerate(sources):
            mine = torch.where(src == source, ref, torch.zeros_like(ref))
            (own[k],), (this,) = _own_and_partner(mine[None])
            if k and not torch.equal(this, partner):
                raise _NotPair("the projections of a head are rotated differently")
            partner = this
        rotated = partner >= 0
        back = partner.clamp_min(0)[partner.clamp_min(0)]
        if bool((rotated & (back != torch.arange(columns))).any()):
            raise _NotPair("columns are mixed, but not in rotation planes")
        biases = self.added(ids, partner, own[0])
        return _Node(own, sources, tuple(partner.tolist()), biases, taint)

    def added(self, ids: Tensor, partner: Tensor, own: Tensor) -> dict[int, Tensor]:
        """Per parameter added to the node's columns, its positions ``(rows, columns)``:
        one row for a bias; every row of a table looked up or of memory tokens."""
        entries = ids[ids >= PARAM_BASE]
        if not entries.numel():
            return {}
        out = {}
        columns = ids.shape[2]
        where = ids >= PARAM_BASE
        col_of = torch.arange(columns).view(1, 1, -1, 1).expand(ids.shape)[where]
        params = ids[where] // PARAM_BASE - 1
        positions = ids[where] % PARAM_BASE
        for p in params.unique().tolist():
            mine = params == p
            seen = [positions[mine & (col_of == c)].unique() for c in range(columns)]
            if any(not len(s) for s in seen):
                raise _NotPair("a parameter is added to some columns of a head only")
            seen = _own_entries(seen, partner, own)
            out[p] = self.rows_of(p, seen)
        return out

    def rows_of(self, p: int, seen: list[Tensor]) -> Tensor:
        """Positions ``(rows, columns)`` of parameter ``p`` in the node: per column the
        entries ``seen``, along every axis they vary along (or rows were looked up
        along) all of the parameter's rows."""
        shape = self.trace.shapes[p]
        strides = _contiguous_strides(shape)
        multi = [_unravel(s, shape) for s in seen]  # each (entries, dims)
        axes = set(self.trace.lookups.get(self.trace.params[p], set()))
        for m in multi:
            axes |= {
                d for d in range(len(shape)) if len(m) > 1 and bool((m[:, d] != m[0, d]).any())
            }
        axes = sorted(axes)
        if not axes:
            if any(len(s) != 1 for s in seen):
                raise _NotPair("one parameter is added twice to a head")
            return torch.stack([s[:1] for s in seen], 1)
        grid = torch.cartesian_prod(*[torch.arange(shape[d]) for d in axes]).reshape(-1, len(axes))
        cols = []
        for m in multi:
            base = m[0].clone()
            full = base.expand(len(grid), -1).clone()
            full[:, axes] = grid
            cols.append((full * torch.tensor(strides)).sum(1))
        return torch.stack(cols, 1)

    # -- the events ------------------------------------------------------------------------

    def run(self) -> Assembly:
        pairs: list[PairSpec] = []
        dropped: list[Dropped] = []
        attention: list[str] = []
        tainted: dict[str, tuple[str, bool, bool]] = {}
        features: dict[str, Tensor] = {}
        qk = self.query_key()
        vo = self.value_output()  # the modules whose scores mix values: attention
        for module in dict.fromkeys([*qk, *vo]):
            is_attention = module in vo
            results = []
            for kind, (comps, failure) in self.kinds(module, qk, vo):
                if failure is not None:
                    results.append((kind, [], failure))
                    continue
                try:
                    results.append((kind, self.stack(module, kind, comps), None))
                except _NotPair as err:
                    results.append((kind, [], err))
            specs = [s for _, found, _ in results for s, _ in found]
            # named by the smallest module that holds its parameters and its events
            where = [] if module in ("", "<root>") else [f"{module}.<events>"]
            unit = _common_module([p for spec in specs for p in spec.params] + where)
            name = unit if unit is not None and specs else module
            for spec, comps in _unique_kinds([f for _, found, _ in results for f in found]):
                spec = replace(spec, module=name)
                pairs.append(spec)
                features[spec.name] = self.features_of(comps)
                why = self.why_tainted(comps)
                if why is not None:
                    tainted[spec.name] = why
            if is_attention:
                attention.append(name)
            for kind, _, err in results:
                if err is not None:
                    dropped.append(Dropped(name, kind, err.reason, err.exact))
        return Assembly(
            pairs, list(dict.fromkeys(attention)), dropped, set(self.trace.ran),
            list(self.trace.opaque), dict(self.trace.uses), self.unknown(), tainted, features,
        )  # fmt: skip

    def kinds(self, module: str, qk: dict, vo: dict) -> list[tuple[str, tuple]]:
        """The pair kinds of ``module`` with their components (or why there are none)."""
        out = []
        if module in qk:
            for kind, value in qk[module].items():
                out.append((kind, value))
        elif module in vo:
            reason = "its scores are not a product of projections the trace can follow"
            out.append(("query-key", ([], _NotPair(reason))))
        if module in vo:
            out.append(("value-output", vo[module]))
        return out

    def features_of(self, comps: list) -> Tensor:
        """The feature ids a pair holds, as runs: its nodes' and those of the
        projections that weights reading a head make (terms of its scores)."""
        ids = [n.features for c in comps for n in c.all_nodes()]
        for c in comps:
            for n in getattr(c, "g", []) + getattr(c, "h", []):
                if isinstance(n, _ParamNode) and n.source >= 0:
                    src = self.trace.sources[n.source]
                    ids.append(torch.arange(src.base, src.base + src.size))
        return _runs_of(torch.cat(ids))

    def why_tainted(self, comps: list) -> tuple[str, bool, bool] | None:
        """Why the features of ``comps`` are not linear in their projections (their own
        ops, or a use anywhere), if they are not: the reason, whether it is certain,
        and whether no continuous symmetry survives it (a function of each element)."""
        for comp in comps:
            for n in comp.all_nodes():
                if n.taint is not None:
                    return _reason(n.taint.reason), n.taint.certain, n.taint.keeps_nothing
        found = self.taints.reason(torch.cat([n.features for c in comps for n in c.all_nodes()]))
        if found is not None:
            return _reason(found[0]), found[1], False
        return None

    def unknown(self) -> list[tuple[str, str, frozenset[str], Tensor, frozenset[str]]]:
        """The ops the trace could not look into, with the parameters whose features or
        weight matrices entered each (every projection a run of feature ids overlaps)."""
        out = []
        for runs, reason, module, matrices in self.trace.unknown:
            lo = self.source_of(runs[:, 0]).tolist() if len(runs) else []
            hi = self.source_of(runs[:, 1] - 1).tolist() if len(runs) else []
            params = frozenset(
                self.trace.sources[i].param for a, b in zip(lo, hi) for i in range(a, b + 1)
            )
            out.append((module, reason, params | matrices, runs, matrices))
        return out

    def query_key(self) -> dict[str, dict[str, tuple[list, _NotPair | None]]]:
        """Per module, per kind (``"query-key"`` for attention, ``"product"`` for a core
        whose scores mix no values), its components (or why there are none)."""
        graph = _Graph()
        failures: dict[tuple[str, str], _NotPair] = {}
        order: list[tuple[str, str]] = []
        for core in self.trace.cores:
            kind = "query-key" if core.index in self.attention_cores else "product"
            if (core.module, kind) not in order:
                order.append((core.module, kind))
            if (core.module, kind) in failures:
                continue
            try:
                self.core(core, graph, kind)
            except _NotPair as err:
                failures[core.module, kind] = err
        self.readers(graph)
        comps: dict[tuple[str, str], list] = defaultdict(list)
        for comp in graph.components():
            if (comp.module, comp.kind) not in failures:
                comps[comp.module, comp.kind].append(comp)
        out: dict[str, dict[str, tuple]] = defaultdict(dict)
        for module, kind in order:
            if (module, kind) in failures:
                out[module][kind] = ([], failures[module, kind])
            else:
                out[module][kind] = (comps[module, kind], None)
        return out

    def readers(self, graph: _Graph) -> None:
        """Weights that read a query or key head's features join the opposite side."""
        for cons in self.trace.consumptions:
            ids = cons.feat.ids
            if cons.mix is not None or ids is None:
                continue
            slices = cons.slice_offsets()
            for l in range(ids.shape[0]):
                feats = ids[l, 0, :, 0]
                key = graph.owner.get(int(feats[0])) if len(feats) else None
                if key is None or not torch.equal(graph.nodes[key].own[0], feats):
                    continue
                side = Side(ids=ids[l : l + 1], taint=cons.feat.taint)
                node = self.slice_nodes(side, torch.arange(ids.shape[2]), "queries")[0]
                reader = _ParamNode(
                    cons.weight.param,
                    cons.weight.offset + int(slices[l % len(slices)]),
                    cons.row_offsets(),
                    cons.col_offsets(torch.arange(ids.shape[2])),
                    cons.source,
                )
                graph.edge(node, reader, graph.module[key], graph.kind[key], core=False)

    def core(self, core: Core, graph: _Graph, kind: str) -> None:
        left, right = core.left, core.right
        for side, what in ((left, "queries"), (right, "keys")):
            if side.ids is None:
                reason = side.taint.reason
                raise _NotPair(f"{what} {_reason(reason)}", exact=side.taint.certain)
        if left.batch != right.batch:
            raise _NotPair("the two operands of the scores have different slices")
        for cols in self.column_groups([left, right]):
            lnodes = self.slice_nodes(left, cols, "queries")
            rnodes = self.slice_nodes(right, cols, "keys")
            for b in range(left.batch):
                for i in range(left.stacked):
                    for j in range(right.stacked):
                        a, z = lnodes[b * left.stacked + i], rnodes[b * right.stacked + j]
                        if a is not None and z is not None:  # no padding
                            graph.edge(a, z, core.module, kind)

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
            if mixing.ids is None:
                if mixing.taint is not None:
                    reason = f"values {_reason(mixing.taint.reason)}"
                    out[module] = ([], _NotPair(reason, mixing.taint.certain))
                elif module not in out:
                    reason = "its values are not projected: there is no value/output pair"
                    out[module] = ([], _NotPair(reason, exact=True))
                continue
            try:
                comps = self.value_components(mixing, by_mix.get(mixing.index, []))
                out[module] = (_joined_values(out.get(module, ([], None))[0] + comps), None)
            except _NotPair as err:
                out[module] = ([], err)
        return _across_modules(out)

    def value_components(self, mixing: Mixing, consumers: list[Consumption]) -> list:
        side = Side(ids=mixing.ids, taint=mixing.taint)
        nodes = []
        for cols in self.column_groups([side]):
            if len(cols) != side.ids.shape[2]:
                raise _NotPair("a value head's columns come from different projections")
            found = [n for n in self.slice_nodes(side, cols, "values") if n is not None]
            nodes = list({n.key: n for n in found}.values())
        if not consumers:
            reason = self.taints.reason(torch.cat([n.features for n in nodes]))
            if reason is not None:
                raise _NotPair(f"the attention output {_reason(reason[0])}", reason[1])
            raise _NotPair("the attention output reaches no projection", exact=True)
        known = torch.cat([n.features for n in nodes])
        params = {p for n in nodes for p in n.biases}
        reads = []  # per consumer: its input columns sorted by the feature they read
        taint = None
        for consumer in consumers:
            ids = consumer.feat.ids
            if ids is None or ids.shape[0] != 1:
                raise _NotPair("the attention output is read per slice by a weight")
            taint = taint or consumer.feat.taint
            own = ids[0, 0, :, 0]
            extra = ids[0, :, :, 1:]
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
            if taint is not None and node.taint is None:
                node = replace(node, taint=taint)
            columns = []
            for consumer, ordered, order in reads:
                lo = torch.searchsorted(ordered, node.own[0].contiguous())
                hi = torch.searchsorted(ordered, node.own[0].contiguous(), right=True)
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
        return comps

    # -- blocks ----------------------------------------------------------------------------

    def stack(self, module: str, kind: str, comps: list) -> list[tuple[PairSpec, list]]:
        """Components of one module and kind, stacked as heads where their layouts agree
        (one :class:`PairSpec` per layout), split into rotary and pass-through parts."""
        groups: dict[tuple, list] = defaultdict(list)
        for comp in comps:
            groups[comp.signature()].append(comp)
        out = []
        for comps_of in groups.values():
            out.extend((spec, comps_of) for spec in self.specs(module, kind, comps_of))
        return out

    def specs(self, module: str, kind: str, comps: list) -> list[PairSpec]:
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
        note = f"{stack} query heads share each key/value head" if stack > 1 else ""
        specs = []
        for part_kind, columns, group in parts:
            cols = torch.tensor(columns, dtype=_I64)
            g = tuple(first.blocks(self, comps, "g", cols))
            hb = tuple(first.blocks(self, comps, "h", cols))
            specs.append(
                PairSpec(module, part_kind, g, hb, group=group, note=note, query_heads=stack)
            )
        return specs

    def weight_block(self, source: int, own: Tensor, cols: Tensor) -> Block:
        """The rows of projection ``source`` for features ``own`` ``(heads, stacked,
        columns)``."""
        src = self.trace.sources[source]
        offsets = src.offset + src.feature_offsets(own[:, :, cols] - src.base)
        return _block(src.param, offsets, _axes_offsets(src.rows))

    def bias_block(self, source: int, own: Tensor, cols: Tensor) -> Block | None:
        src = self.trace.sources[source]
        if src.bias is None:
            return None
        bias = src.bias
        positions = bias.offset + _flat_offsets(
            bias.shape, bias.strides, own[:, :, cols] - src.base
        )
        return _block(bias.param, positions, torch.zeros(1, dtype=_I64))

    def added_blocks(self, nodes_per_head: list[list[_Node]], cols: Tensor) -> list[Block]:
        keys = sorted(nodes_per_head[0][0].biases)
        out = []
        for p in keys:
            # (heads, stacked * rows, columns): the rows of each stacked node in turn
            positions = torch.stack(
                [torch.cat([n.biases[p][:, cols] for n in nodes]) for nodes in nodes_per_head]
            )
            out.append(_block_rows(self.trace.params[p], positions))
        return out


# --- components -----------------------------------------------------------------------------


class _QueryKeyComponent:
    """Nodes of one bilinear form: ``g`` (the side of the first query operand) and
    ``h``."""

    def __init__(self, module: str, kind: str, g: list, h: list):
        self.module, self.kind = module, kind
        self.g, self.h = g, h

    def all_nodes(self) -> list[_Node]:
        return [n for n in self.g + self.h if isinstance(n, _Node)]

    def partner(self) -> tuple[int, ...]:
        return self.all_nodes()[0].partner

    def stack_size(self) -> int:
        return len(self.g) if len(self.h) == 1 else 1

    def signature(self) -> tuple:
        def side(nodes):
            return tuple(
                (n.sources, n.partner, tuple((p, len(b)) for p, b in sorted(n.biases.items())))
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

    kind = "value-output"

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

    def signature(self) -> tuple:
        readers = tuple((c.weight.param, cols.shape[0]) for c, cols in self.reads)
        biases = tuple((p, len(b)) for p, b in sorted(self.node.biases.items()))
        return ("vo", self.node.sources, self.node.partner, biases, readers)

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


def _joined_values(comps: list[_ValueComponent]) -> list[_ValueComponent]:
    """Value heads of one module, one per head: a head mixed again (by another layer's
    scores, or in another call of a shared block) is one head read by every weight that
    reads it; heads that share a projection's features (a block shared across depth,
    an adapter added per call) one head of all their projections."""
    out: list[_ValueComponent] = []
    owner: dict[int, int] = {}  # a feature -> the head in ``out`` that holds it
    for comp in comps:
        features = comp.node.features.tolist()
        held = {owner[f] for f in features if f in owner}
        if not held:
            for f in features:
                owner[f] = len(out)
            out.append(comp)
            continue
        if len(held) > 1:
            raise _NotPair("a value head holds the features of several other heads")
        (i,) = held
        same = out[i]
        node = same.node if same.node.key == comp.node.key else _union(same.node, comp.node)
        reads = list(same.reads)
        for consumer, cols in comp.reads:
            if not any(_same_read(consumer, cols, c, k) for c, k in reads):
                reads.append((consumer, cols))
        out[i] = _ValueComponent(same.module, node, reads)
        for f in node.features.tolist():
            owner[f] = i
    return out


def _across_modules(out: dict[str, tuple[list, _NotPair | None]]) -> dict:
    """Value heads mixed in several modules (layers that read one layer's values, a
    block whose calls are modules of their own with tied weights): one head, in the
    first module."""
    first: dict[int, str] = {}  # a feature -> the first module whose heads hold it
    for module, (comps, failure) in list(out.items()):
        if failure is not None:
            continue
        moved: dict[str, list] = {}
        for comp in comps:
            features = comp.node.features.tolist()
            earlier = {first[f] for f in features if f in first} - {module}
            if earlier:
                moved.setdefault(min(earlier, key=list(out).index), []).append(comp)
            else:
                for f in features:
                    first.setdefault(f, module)
        for target, comps_of in moved.items():
            try:
                out[target] = (_joined_values(out[target][0] + comps_of), out[target][1])
            except _NotPair as err:
                out[target] = out[module] = ([], err)
                break
            out[module] = ([c for c in out[module][0] if c not in comps_of], None)
    return out


def _same_read(a: Consumption, cols_a: Tensor, b: Consumption, cols_b: Tensor) -> bool:
    return (
        a.weight.param == b.weight.param
        and a.weight.offset == b.weight.offset
        and a.rows == b.rows
        and a.cols == b.cols
        and torch.equal(cols_a, cols_b)
    )


def _node_blocks(builder: _Builder, per_head: list[list], cols: Tensor) -> list[Block]:
    """Weight rows of the stacked nodes (per projection summed in them), then their
    biases, then added parameters, then weights that read them; consecutive nodes of
    one layout share a block."""
    first = per_head[0]
    features = [i for i, n in enumerate(first) if isinstance(n, _Node)]
    readers = [i for i, n in enumerate(first) if isinstance(n, _ParamNode)]
    weights, biases, added = [], [], []
    for a, b in _runs([first[i].sources for i in features], features):
        run = [nodes[a:b] for nodes in per_head]
        for k, source in enumerate(run[0][0].sources):
            own = torch.stack([torch.stack([n.own[k] for n in nodes]) for nodes in run])
            weights.append(builder.weight_block(source, own, cols))
            bias = builder.bias_block(source, own, cols)
            if bias is not None:
                biases.append(bias)
        added.extend(builder.added_blocks(run, cols))
    for i in readers:
        nodes = [heads[i] for heads in per_head]
        heads_cols = torch.stack([(n.base + n.cols[cols])[None, :] for n in nodes])
        added.append(_block(nodes[0].param, heads_cols, nodes[0].rows))
    return weights + biases + added


def _runs(keys: list, index: list[int]) -> list[tuple[int, int]]:
    """``(start, stop)`` of consecutive positions (``index``) with one key."""
    runs = []
    start = 0
    for j in range(1, len(index) + 1):
        if j == len(index) or keys[j] != keys[start] or index[j] != index[j - 1] + 1:
            runs.append((index[start], index[j - 1] + 1))
            start = j
    return runs


def _unique_kinds(found: list[tuple[PairSpec, list]]) -> list[tuple[PairSpec, list]]:
    """The pairs of one module with distinct kinds: beside a rotary pair of a kind, the
    plain pairs of that kind are its ``-pass`` part (latent attention's columns without
    a rotary embedding); a kind given twice otherwise is numbered from its second."""
    rotary = {spec.kind for spec, _ in found if spec.group != "GL"}
    seen: dict[str, int] = {}
    out = []
    for spec, comps in found:
        kind = spec.kind
        if kind in rotary and spec.group == "GL":
            kind = f"{kind}-pass"
        n = seen.get(kind, 0) + 1
        seen[kind] = n
        out.append((replace(spec, kind=kind if n == 1 else f"{kind}-{n}"), comps))
    return out


# --- graph ------------------------------------------------------------------------------


class _Graph:
    """Nodes joined by the cores they meet in, with a two-colouring; nodes that hold one
    projection's features (a shared block's calls) are one node of all their
    projections."""

    def __init__(self):
        self.nodes: dict[bytes, _Node] = {}
        self.module: dict[bytes, str] = {}
        self.kind: dict[bytes, str] = {}
        self.adj: dict[bytes, list[bytes]] = defaultdict(list)
        self.order: list[bytes] = []
        self.position: dict[bytes, int] = {}
        self.first_left: set[bytes] = set()
        self.owner: dict[int, bytes] = {}  # a row's first and last features -> its node
        self.alias: dict[bytes, bytes] = {}

    def find(self, key: bytes) -> bytes:
        while key in self.alias:
            key = self.alias[key]
        return key

    def add(self, n, module: str, kind: str) -> bytes:
        """The key of node ``n`` in the graph (merged with nodes sharing its features)."""
        key = self.find(n.key)
        if key in self.nodes:
            if isinstance(n, _Node):
                _merge(self.nodes[key], n)
            self.kind[key] = _kind_of(self.kind[key], kind)
            return key
        if isinstance(n, _Node):
            # nodes that share a projection share its row: its first and last columns
            ends = n.own[:, [0, -1]].reshape(-1).tolist()
            shared = {self.find(self.owner[f]) for f in ends if f in self.owner}
            if shared:
                (other,) = shared if len(shared) == 1 else (None,)
                if other is None or not _shares_a_projection(self.nodes[other], n):
                    raise _NotPair("a head holds some of the features of other heads")
                merged = _union(self.nodes[other], n)
                self.nodes[other] = merged
                self.alias[n.key] = other
                for f in merged.own[:, [0, -1]].reshape(-1).tolist():
                    self.owner[f] = other
                self.kind[other] = _kind_of(self.kind[other], kind)
                return other
            for f in ends:
                self.owner[f] = n.key
        self.nodes[n.key] = n
        self.module[n.key] = module
        self.kind[n.key] = kind
        self.position[n.key] = len(self.order)
        self.order.append(n.key)
        return n.key

    def edge(self, a, b, module: str, kind: str, core: bool = True) -> None:
        ka, kb = self.add(a, module, kind), self.add(b, module, kind)
        if ka == kb:
            raise _NotPair("a projection meets itself in the scores")
        if kb not in self.adj[ka]:
            self.adj[ka].append(kb)
            self.adj[kb].append(ka)
        if core:
            self.first_left.add(ka)

    def components(self) -> list[_QueryKeyComponent]:
        colour: dict[bytes, int] = {}
        out = []
        for start in self.order:
            if start in colour or start in self.alias:
                continue
            first = 0 if start in self.first_left else 1
            colour[start] = first
            members, queue = [start], [start]
            while queue:
                k = queue.pop()
                for n in self.adj[k]:
                    n = self.find(n)
                    if n not in colour:
                        colour[n] = 1 - colour[k]
                        members.append(n)
                        queue.append(n)
                    elif colour[n] == colour[k]:
                        raise _NotPair("queries meet queries in the scores (no two sides)")
            members.sort(key=self.position.__getitem__)
            g = [self.nodes[k] for k in members if colour[k] == first]
            h = [self.nodes[k] for k in members if colour[k] != first]
            kind = self.kind[start]
            for k in members:
                kind = _kind_of(kind, self.kind[k])
            out.append(_QueryKeyComponent(self.module[start], kind, g, h))
        return out


def _kind_of(a: str, b: str) -> str:
    """A component in attention anywhere is attention's."""
    return "query-key" if "query-key" in (a, b) else a


def _merge(kept: _Node, seen: _Node) -> None:
    """One head met in several scores, with different parameters added (Funnel's
    content and position biases): all of them are rows of its side."""
    if kept.partner != seen.partner:
        raise _NotPair("a head is rotated differently in different scores")
    for p, positions in seen.biases.items():
        if p in kept.biases and not torch.equal(kept.biases[p], positions):
            raise _NotPair("a head is added different entries of one parameter")
        kept.biases.setdefault(p, positions)
    kept.taint = kept.taint or seen.taint


def _shares_a_projection(a: _Node, b: _Node) -> bool:
    """Whether two nodes hold one projection's features in the same columns, and no
    other feature in common (a block called twice, with another adapter each time)."""
    common = set(a.sources) & set(b.sources)
    if not common:
        return False
    for s in common:
        if not torch.equal(a.own[a.sources.index(s)], b.own[b.sources.index(s)]):
            return False
    rest_a = {f for k, s in enumerate(a.sources) if s not in common for f in a.own[k].tolist()}
    rest_b = {f for k, s in enumerate(b.sources) if s not in common for f in b.own[k].tolist()}
    return not (rest_a & rest_b)


def _union(kept: _Node, seen: _Node) -> _Node:
    """The node of every projection of two nodes that share some (one block called
    with different adapters): its rows are all of theirs."""
    if kept.own.shape[1] != seen.own.shape[1]:
        raise _NotPair("one projection is read in heads of different layouts: no joint pair")
    if kept.partner != seen.partner:
        raise _NotPair("a head is rotated differently in different calls")
    sources, own = list(kept.sources), [kept.own]
    for k, s in enumerate(seen.sources):
        if s in sources:
            if not torch.equal(kept.own[sources.index(s)], seen.own[k]):
                raise _NotPair(
                    "one projection is read in heads of different layouts: no joint pair"
                )
            continue
        sources.append(s)
        own.append(seen.own[k : k + 1])
    biases = dict(kept.biases)
    for p, positions in seen.biases.items():
        if p in biases and not torch.equal(biases[p], positions):
            raise _NotPair("a head is added different entries of one parameter")
        biases.setdefault(p, positions)
    node = _Node(torch.cat(own), tuple(sources), kept.partner, biases, kept.taint or seen.taint)
    node.key = kept.key
    return node


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
        ordered = features.reshape(-1).sort().values
        # a run [start, stop) holds one of the features where it holds the first one
        # at or after its start
        at = torch.searchsorted(ordered, self.starts)
        hit = (at < len(ordered)) & (ordered[at.clamp_max(len(ordered) - 1)] < self.stops)
        if not bool(hit.any()):
            return None
        _, reason, certain, _ = self.taints[int(self.event[hit].min())]
        return reason, certain


def _reason(text: str) -> str:
    return f"pass through {text}" if text else "are not linear in their projection"


def _own_and_partner(mine: Tensor) -> tuple[Tensor, Tensor]:
    """Per node and column, its own feature and the column rotated with it (-1: none),
    from the features ``mine[n, c, s]`` of one projection in each column (0: none): a
    column holds one feature, or two (its own and its partner's, a rotation plane),
    which the other column of the plane holds too; in a plane the smaller feature is
    the smaller column's own. All nodes at once: ``(nodes, columns)`` each."""
    n, columns = mine.shape[:2]
    top = torch.sort(mine, dim=2, descending=True).values
    hi = top[:, :, 0]
    lo = top[:, :, 1] if top.shape[2] > 1 else torch.zeros_like(hi)
    if top.shape[2] > 2 and bool((top[:, :, 2] != 0).any()):
        raise _NotPair("a column mixes features of different heads or projections")
    if bool((hi == 0).any()):
        raise _NotPair("a head's columns come from different projections")
    own = hi.clone()
    partner = torch.full((n, columns), -1, dtype=_I64)
    plane = lo != 0
    if bool(plane.any()):
        # the two columns of a plane hold the same two features: equal keys, adjacent
        # once sorted; a column outside planes gets a key of its own
        column = torch.arange(columns).expand(n, columns)
        # sorted by (lo, hi): stably by hi, then by lo
        first_key = torch.where(plane, lo, -(column + 1))
        second_key = torch.where(plane, hi, torch.zeros_like(hi))
        by_hi = torch.sort(second_key, dim=1, stable=True).indices
        by_lo = torch.sort(torch.gather(first_key, 1, by_hi), dim=1, stable=True).indices
        at = torch.gather(by_hi, 1, by_lo)
        a, b = torch.gather(first_key, 1, at), torch.gather(second_key, 1, at)
        in_plane = a > 0
        twin_next = torch.zeros_like(plane)
        twin_next[:, :-1] = (a[:, :-1] == a[:, 1:]) & (b[:, :-1] == b[:, 1:]) & in_plane[:, :-1]
        twin_prev = torch.zeros_like(plane)
        twin_prev[:, 1:] = twin_next[:, :-1]
        if bool((twin_next & twin_prev).any()) or not torch.equal(twin_next | twin_prev, in_plane):
            raise _NotPair("columns are mixed, but not in rotation planes")
        ordered = a
        position = torch.arange(columns).expand(n, columns)
        twin = torch.where(twin_next, position + 1, torch.where(twin_prev, position - 1, position))
        other = torch.gather(at, 1, twin)  # the twin's column, in sorted order
        mate = torch.full((n, columns), -1, dtype=_I64)
        mate.scatter_(1, at, torch.where(ordered > 0, other, torch.full_like(other, -1)))
        partner = mate
        smaller = plane & (column < partner)
        larger = plane & (column > partner)
        own = torch.where(smaller, lo, torch.where(larger, hi, own))
    ordered_own = torch.sort(own, dim=1).values
    if columns > 1 and bool((ordered_own[:, 1:] == ordered_own[:, :-1]).any()):
        raise _NotPair("a head holds one feature in two columns")
    return own, partner


def _own_entries(seen: list[Tensor], partner: Tensor, own: Tensor) -> list[Tensor]:
    """Per column, the entries of a parameter that are its own: a rotated column holds
    its partner's too (a bias added before the rotation), split between the two as their
    features are (in order)."""
    out = list(seen)
    for c in range(len(seen)):
        p = int(partner[c])
        if p < 0:
            continue
        both = seen[c]
        if not torch.equal(both, seen[p]) or len(both) % 2:
            if torch.equal(both, seen[p]):
                raise _NotPair("one parameter is added twice to a head")
            continue  # added after the rotation: each column its own entries
        half = len(both) // 2
        out[c] = both[:half] if bool(own[c] < own[p]) else both[half:]
    return out


def _contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return list(reversed(strides))


def _unravel(flat: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Flat positions as multi-indices ``(n, dims)`` of a contiguous ``shape``."""
    out = []
    rest = flat.clone()
    for size in reversed(shape):
        out.append(rest % size)
        rest = rest // size
    return torch.stack(list(reversed(out)), 1) if out else flat[:, None]


def _runs_of(ids: Tensor) -> Tensor:
    """Feature ids as sorted runs ``[start, stop)``."""
    t = ids.unique()
    if not t.numel():
        return torch.zeros(0, 2, dtype=_I64)
    cut = torch.nonzero(t[1:] - t[:-1] != 1).flatten() + 1
    return torch.stack([torch.cat([t[:1], t[cut]]), torch.cat([t[cut - 1] + 1, t[-1:] + 1])], 1)


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


def _block_rows(param: str, positions: Tensor) -> Block:
    """Block of positions ``(heads, rows, columns)`` (separable where it is)."""
    return _block(param, positions, torch.zeros(1, dtype=_I64))


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
