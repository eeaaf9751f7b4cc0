r"""Blocks of parameters for per-layer and per-module sharpness.

The sharpness of a block :math:`B` is the measure with every parameter outside
:math:`B` fixed: the ball of radius :math:`\rho` (the same geometry, norm and radius as
the whole-model measure) in the subspace of :math:`B`,

.. math:: S_B(\rho) = \max_{\xi_B:\ \|\xi_B\|_g \le \rho} L(\gamma_{\xi_B}(1)) - L(\theta).

A geodesic block value is symmetry-invariant only if every attention pair lies wholly
inside one block, so blocks are found from the model's structure and then merged along
its pairs:

* ``per="layer"``: each child of a numbered container (``nn.ModuleList`` or
  ``nn.Sequential``: the transformer blocks), and each module outside such containers
  (embeddings, pooler, head) whose subtree holds none;
* ``per="module"``: each module that owns parameters (a linear layer, a norm), with
  the projections of each attention module's pairs merged into that attention module;
* ``per="head"``: each attention head, the entries of its pair blocks (its rows of
  the query, key and value projections and its columns of the output projection, with
  their biases), measured as a subspace of those parameters (:func:`head_entries`).
  The symmetry acts on each head alone, so these values are invariant too. Under
  grouped-query attention the blocks are key/value heads, named ``kv<k>``, each with
  the query heads that share it.

Blocks of parameters shared between modules, or joined by a pair, are merged into one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..io import dumps

__all__ = ["PER", "BlockSharpness", "head_entries", "parameter_blocks"]

PER = ("layer", "module", "head")


def parameter_blocks(model: nn.Module, per: str, pairs: Sequence = ()) -> dict[str, list[str]]:
    """``{block name: parameter names}`` of the trainable parameters, in the model's
    order; ``pairs`` (:class:`~geosharp.symmetry.pairs.PairSpec`) are kept whole.

    >>> import torch
    >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    >>> parameter_blocks(net, "layer")
    {'0': ['0.weight', '0.bias'], '2': ['2.weight', '2.bias']}
    """
    if per not in PER[:2]:
        raise ValueError(f"per must be 'layer' or 'module' here, got {per!r} (heads: head_entries)")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if not names:
        raise ValueError("no parameter of the model requires grad: there is no block to measure")
    owner = _layers(model) if per == "layer" else _owners(model)
    block = {n: owner.get(n, n.rpartition(".")[0]) for n in names}
    # union-find over blocks: a pair's parameters end in one block, named after the pair's
    # attention module where blocks are modules
    parent = {b: b for b in block.values()}

    def root(b: str) -> str:
        while parent[b] != b:
            parent[b] = parent[parent[b]]
            b = parent[b]
        return b

    for pair in pairs:
        members = [block[n] for n in pair.params if n in block]
        if not members:
            continue
        if per == "module":
            parent.setdefault(pair.module, pair.module)
            target = root(pair.module)
        else:
            target = root(members[0])
        for b in members:
            if root(b) != target:
                parent[root(b)] = target
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(root(block[n]) or "(model)", []).append(n)
    return out


def head_entries(pairs: Sequence) -> dict[str, dict[str, Tensor]]:
    """``{"<module>.head<k>": {parameter: flat positions}}``: the entries of head ``k``'s
    blocks in every pair of an attention module (per pair, ``"<module>:<kind>.head<k>"``,
    when the module's pairs have different numbers of heads). Under grouped-query
    attention a block is a key/value head with the query heads that read it (a key
    head's symmetry acts on all of them at once): ``"<module>.kv<k>"``, holding
    ``pair.query_heads`` query heads."""
    modules: dict[str, list] = {}
    for pair in pairs:
        modules.setdefault(pair.module, []).append(pair)
    out: dict[str, dict[str, Tensor]] = {}
    for module, specs in modules.items():
        if len({p.shape[0] for p in specs}) == 1:
            units = [(module, specs)]
        else:
            units = [(f"{module}:{p.kind}", [p]) for p in specs]
        for name, group in units:
            for k in range(group[0].shape[0]):
                found: dict[str, list[Tensor]] = {}
                for spec in group:
                    for block in (*spec.g_blocks, *spec.h_blocks):
                        found.setdefault(block.param, []).append(block.index[k].reshape(-1))
                unit = "kv" if any(spec.query_heads > 1 for spec in group) else "head"
                out[f"{name}.{unit}{k}"] = {p: torch.unique(torch.cat(v)) for p, v in found.items()}
    return out


def _numbered(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 0


def _layers(model: nn.Module) -> dict[str, str]:
    """The block of each parameter for ``per="layer"``."""
    holds = {}  # module -> whether a numbered container lies in its subtree
    for name, module in reversed(list(model.named_modules(remove_duplicate=False))):
        holds[name] = _numbered(module) or any(
            holds.get(f"{name}.{c}" if name else c, False) for c, _ in module.named_children()
        )
    owner: dict[str, str] = {}

    def visit(module: nn.Module, prefix: str) -> None:
        for pname, _ in module.named_parameters(recurse=False):
            owner.setdefault(_join(prefix, pname), prefix)
        for cname, child in module.named_children():
            path = _join(prefix, cname)
            if _numbered(module) or not holds.get(path, False):
                for pname, _ in child.named_parameters():
                    owner.setdefault(_join(path, pname), path)
            else:
                visit(child, path)

    visit(model, "")  # without numbered containers: each top-level child is a block
    return owner


def _owners(model: nn.Module) -> dict[str, str]:
    """The module that owns each parameter (``per="module"``)."""
    owner: dict[str, str] = {}
    for name, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            owner.setdefault(_join(name, pname), name)
    return owner


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass
class BlockSharpness:
    """The sharpness of each block (:func:`parameter_blocks`) with the rest fixed:
    ``blocks[name]`` is that block's :class:`~geosharp.measures.SharpnessResult`
    (same geometry, radius and estimator for every block); ``parameters[name]`` the
    parameter names of the block."""

    per: str
    blocks: dict = field(default_factory=dict)
    parameters: dict[str, list[str]] = field(default_factory=dict)

    @property
    def values(self) -> dict[str, float]:
        return {name: r.value for name, r in self.blocks.items()}

    @property
    def geometry(self) -> str:
        return next(iter(self.blocks.values())).geometry if self.blocks else ""

    @property
    def rho(self) -> float:
        return next(iter(self.blocks.values())).rho if self.blocks else float("nan")

    def to_dict(self) -> dict:
        return {
            "per": self.per,
            "values": self.values,
            "parameters": self.parameters,
            "blocks": {name: r.to_dict() for name, r in self.blocks.items()},
        }

    def to_json(self, **kwargs) -> str:
        return dumps(self.to_dict(), **{"indent": None, **kwargs})

    def __str__(self) -> str:
        width = max((len(n) for n in self.blocks), default=5)
        lines = [f"{self.geometry} sharpness per {self.per} (rho={self.rho:g}):"]
        lines += [f"  {name:<{width}}  {value:.6g}" for name, value in self.values.items()]
        return "\n".join(lines)
