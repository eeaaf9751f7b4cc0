"""Built-in handlers: layouts declared without a forward pass, and the building blocks
other handlers use (:class:`Projection`, :func:`attention_pairs`).

``torch.nn.MultiheadAttention`` runs as one fused kernel in eval mode, which a trace
cannot look into; timm-style attention is recognised by structure, so that a model
without a batch still gets its pairs. Every other layout (all of ``transformers``) is
found by tracing a forward pass (:mod:`geosharp.symmetry.trace`). The registry they
join is :mod:`geosharp.symmetry.registry`; peft's adapters are in
:mod:`.peft_handlers`.

Layouts (MATH.md, section 1), with ``W`` an ``nn.Linear`` weight (``out x in``):

* query/key, head ``i``: ``G = [W_Q[rows_i]^T ; b_Q[rows_i]]``,
  ``H = [W_K[rows_i]^T ; b_K[rows_i]]``, both ``(d_in + 1) x d_head``;
* value/output, head ``i``: ``G = [W_V[rows_i]^T ; b_V[rows_i]]``,
  ``H = W_O[:, cols_i]`` (``d_out x d_head``).

Grouped-query attention (``kv_heads < heads``, ``r = heads / kv_heads`` query heads
per key/value head ``g``, query heads ``g r, ..., g r + r - 1``): one pair per
key/value head, ``G = [Gq_{g r}; ...; Gq_{g r + r - 1}]`` (rows stacked), ``H = Hk_g``
(query/key), and ``G = Gv_g``, ``H = [Ho_{g r}; ...]`` (value/output).

A pair is claimed only where the module computes exactly ``x W^T + b`` with a plain
parameter ``W``: a projection wrapped by an adapter (LoRA, IA3, ...) or computed by a
parametrisation is left out (its symmetry involves the adapter's tensors too), with a
warning when its weight is trainable.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import Tensor, nn

from ..errors import warn_user
from .pairs import Block, PairSpec, positions
from .registry import NameOf, nested_pairs, register_handler, register_matcher

__all__ = [
    "Projection",
    "attention_pairs",
    "output_blocks",
    "plain_linear",
]


def _is_parameter(tensor: object) -> bool:
    return isinstance(tensor, nn.Parameter)


def plain_linear(layer: nn.Module, prefix: str = "", role: str = "") -> bool:
    """True if ``layer`` is an ``nn.Linear`` with plain parameters. Otherwise, warn if
    it holds trainable tensors whose symmetry is therefore ignored, and return False
    (an adapter wrapper such as peft's LoRA layers, or a parametrisation)."""
    if isinstance(layer, nn.Linear) and not hasattr(layer, "parametrizations"):
        if _is_parameter(layer.weight):
            return True
    warn_skipped(layer, prefix, role)
    return False


def warn_skipped(layer: nn.Module, prefix: str, role: str) -> None:
    base = getattr(layer, "base_layer", None)
    weight = getattr(base if base is not None else layer, "weight", None)
    if isinstance(weight, Tensor) and weight.requires_grad:
        cls = type(layer)
        warn_user(
            f"{prefix}: the {role or 'projection'} is a {cls.__module__}.{cls.__qualname__}, "
            "not a plain linear layer (an adapter wrapper or a parametrisation); the attention "
            "pairs that use it are left out and its weights are measured element-wise"
        )


@dataclass(frozen=True)
class Projection:
    """A per-head projection ``x -> x W^T + b`` into ``heads`` blocks of ``d_head``.

    ``weight`` is ``(heads * d_head, d_in)`` (``nn.Linear`` layout) unless
    ``transposed`` (``d_in x heads * d_head``, GPT-2 ``Conv1D``); ``start`` selects a
    slice of the output features (fused q/k/v weights); ``bias_start`` (default
    ``start``) the slice of the bias, where weights are separate but the bias is fused.
    """

    weight: Tensor
    bias: Tensor | None = None
    start: int = 0
    transposed: bool = False
    bias_start: int | None = None

    def blocks(self, heads: int, d_head: int, name_of: NameOf, stack: int = 1) -> tuple[Block, ...]:
        """Blocks ``(heads / stack, stack * rows, d_head)``: with ``stack > 1``,
        consecutive heads are stacked row-wise into one pair (grouped-query attention)."""
        width = heads * d_head
        pos = positions(self.weight)
        if self.transposed:
            pos = pos.t()
        pos = pos[self.start : self.start + width]
        if pos.shape[0] != width:
            raise ValueError(
                f"{name_of(self.weight)}: expected {width} output features from row "
                f"{self.start}, found {pos.shape[0]}"
            )
        out = [
            Block(
                name_of(self.weight), _stack(pos.reshape(heads, d_head, -1).transpose(1, 2), stack)
            )
        ]
        if self.bias is not None:
            b0 = self.start if self.bias_start is None else self.bias_start
            bpos = positions(self.bias)[b0 : b0 + width]
            out.append(Block(name_of(self.bias), _stack(bpos.reshape(heads, 1, d_head), stack)))
        return tuple(out)


def _stack(index: Tensor, stack: int) -> Tensor:
    """``(heads, rows, h) -> (heads / stack, stack * rows, h)``."""
    heads, rows, h = index.shape
    if heads % stack:
        raise ValueError(f"{heads} heads cannot be grouped by {stack}")
    return index.reshape(heads // stack, stack * rows, h)


def output_blocks(
    weight: Tensor,
    heads: int,
    d_head: int,
    name_of: NameOf,
    transposed: bool = False,
    stack: int = 1,
) -> tuple[Block, ...]:
    """``H_i = W_O[:, cols of head i]`` for an output weight ``(d_out, heads * d_head)``;
    ``stack`` consecutive heads are stacked row-wise (grouped-query attention)."""
    pos = positions(weight)
    if transposed:
        pos = pos.t()
    if pos.shape[1] != heads * d_head:
        raise ValueError(
            f"{name_of(weight)}: expected {heads * d_head} input features, found {pos.shape[1]}"
        )
    index = pos.reshape(pos.shape[0], heads, d_head).transpose(0, 1)
    return (Block(name_of(weight), _stack(index, stack)),)


def attention_pairs(
    module: str,
    heads: int,
    d_head: int,
    name_of: NameOf,
    query: Projection | None,
    key: Projection | None,
    value: Projection | None,
    output: Tensor | None,
    output_transposed: bool = False,
    extra_key_rows: tuple[Block, ...] = (),
    extra_value_rows: tuple[Block, ...] = (),
    kv_heads: int | None = None,
    query_key_group: str = "GL",
) -> list[PairSpec]:
    """The query/key and value/output pairs of a multi-head attention.

    ``kv_heads`` (default ``heads``) key/value heads shared by ``heads / kv_heads``
    query heads each (grouped-query / multi-query attention): one query/key and one
    value/output pair per key/value head. ``query_key_group`` is ``"rotary"`` under
    rotary position embeddings. A ``None`` projection leaves its pair out.
    """
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise ValueError(f"{module}: {heads} query heads cannot share {kv_heads} key heads")
    stack = heads // kv_heads
    note = f"{stack} query heads share each key/value head" if stack > 1 else ""
    pairs = []
    if query is not None and key is not None:
        pairs.append(
            PairSpec(
                module,
                "query-key",
                query.blocks(heads, d_head, name_of, stack),
                key.blocks(kv_heads, d_head, name_of) + extra_key_rows,
                group=query_key_group,
                note=note,
            )
        )
    if value is not None and output is not None:
        pairs.append(
            PairSpec(
                module,
                "value-output",
                value.blocks(kv_heads, d_head, name_of) + extra_value_rows,
                output_blocks(output, heads, d_head, name_of, output_transposed, stack),
                note=note,
            )
        )
    return pairs


# --- torch.nn ---------------------------------------------------------------------


def _multihead_attention(module: nn.Module, prefix: str, name_of: NameOf) -> list[PairSpec]:
    assert isinstance(module, nn.MultiheadAttention)
    heads, d_head, embed = module.num_heads, module.head_dim, module.embed_dim
    bias = module.in_proj_bias
    if module._qkv_same_embed_dim:
        w = module.in_proj_weight
        q, k, v = (Projection(w, bias, start=i * embed) for i in range(3))
    else:
        # Separate weights, each (embed, d_in), share one fused bias.
        q, k, v = (
            Projection(w, bias, bias_start=i * embed)
            for i, w in enumerate(
                (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
            )
        )
    # add_bias_kv appends one key and one value (already projected) to the sequence:
    # they act as one more row of H (query/key) and of G (value/output).
    extra_k = extra_v = ()
    if module.bias_k is not None:
        extra_k = (
            Block(name_of(module.bias_k), positions(module.bias_k).reshape(heads, 1, d_head)),
        )
        extra_v = (
            Block(name_of(module.bias_v), positions(module.bias_v).reshape(heads, 1, d_head)),
        )
    plain = plain_linear(module.out_proj, prefix, "out_proj")
    out_proj = module.out_proj.weight if plain else None
    return attention_pairs(
        prefix,
        heads,
        d_head,
        name_of,
        q,
        k,
        v,
        out_proj,
        extra_key_rows=extra_k,
        extra_value_rows=extra_v,
    )


register_handler(nn.MultiheadAttention, _multihead_attention)


# --- timm-style attention with a fused qkv linear layer -----------------------------
#
# timm's ``vision_transformer.Attention`` (and modules built the same way):
# ``qkv = nn.Linear(dim, 3 * heads * head_dim)`` whose output features are ordered
# (q | k | v) x heads x head_dim, optional per-head ``q_norm`` / ``k_norm``, an optional
# ``norm`` on the concatenated heads, then ``proj``. Recognised by structure, since
# timm itself need not be importable.

_TIMM_CHILDREN = {"qkv", "q_norm", "k_norm", "attn_drop", "norm", "proj", "proj_drop"}


def _is_identity(module: nn.Module | None) -> bool:
    return module is None or isinstance(module, nn.Identity)


def _linear_like(layer: object) -> bool:
    """An ``nn.Linear``, or an adapter wrapping one (peft's ``base_layer``)."""
    base = getattr(layer, "get_base_layer", None)
    return isinstance(layer, nn.Linear) or (callable(base) and isinstance(base(), nn.Linear))


def is_timm_attention(module: nn.Module) -> bool:
    """A module named ``Attention`` with exactly timm's structure: ``qkv`` and ``proj``
    linear layers (possibly wrapped by adapters), ``num_heads``, no parameters of its
    own, no other children, and a ``forward`` that takes no position argument (no
    rotary embedding)."""
    if type(module).__name__ != "Attention":
        return False
    qkv, proj = getattr(module, "qkv", None), getattr(module, "proj", None)
    heads = getattr(module, "num_heads", None)
    if not (_linear_like(qkv) and _linear_like(proj) and isinstance(heads, int)):
        return False
    if set(dict(module.named_children())) - _TIMM_CHILDREN or any(
        True for _ in module.named_parameters(recurse=False)
    ):
        return False
    width = proj.in_features
    if qkv.out_features != 3 * width or width % heads:
        return False
    accepted = {"self", "x", "attn_mask", "mask"}
    params = inspect.signature(type(module).forward).parameters
    return set(params) <= accepted


def _timm_attention(module: nn.Module, prefix: str, name_of: NameOf) -> list[PairSpec]:
    """timm-style fused-qkv attention. Per-head ``q_norm``/``k_norm`` (LayerNorm,
    RMSNorm) normalise queries and keys: the query/key symmetry is gone, only the
    value/output pair is kept; a ``norm`` before ``proj`` likewise removes the
    value/output pair."""
    heads = module.num_heads
    width = module.proj.in_features
    d_head = getattr(module, "head_dim", width // heads)
    if d_head * heads != width:
        return []
    qkv = module.qkv
    if not plain_linear(qkv, prefix, "qkv"):
        return nested_pairs(module, prefix, name_of)
    q, k, v = (Projection(qkv.weight, qkv.bias, start=i * width) for i in range(3))
    if not (
        _is_identity(getattr(module, "q_norm", None))
        and _is_identity(getattr(module, "k_norm", None))
    ):
        q = k = None
    output = module.proj.weight if plain_linear(module.proj, prefix, "proj") else None
    if not _is_identity(getattr(module, "norm", None)):
        output = None
    return attention_pairs(prefix, heads, d_head, name_of, q, k, v, output) + nested_pairs(
        module, prefix, name_of
    )


register_matcher(is_timm_attention, _timm_attention)
