"""Handlers: how each supported attention module stores its ``(G, H)`` pairs.

A handler is ``handler(module, prefix, name_of) -> list[PairSpec]`` where ``name_of``
maps a parameter tensor of the model to its name. Handlers are looked up by the
module's class (exact class or qualified class name, so ``transformers`` is never
imported here); register your own with :func:`register_handler`.

Layouts (MATH.md, section 1), with ``W`` an ``nn.Linear`` weight (``out x in``):

* query/key, head ``i``: ``G = [W_Q[rows_i]^T ; b_Q[rows_i]]``,
  ``H = [W_K[rows_i]^T ; b_K[rows_i]]``, both ``(d_in + 1) x d_head``;
* value/output, head ``i``: ``G = [W_V[rows_i]^T ; b_V[rows_i]]``,
  ``H = W_O[:, cols_i]`` (``d_out x d_head``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from .pairs import Block, PairSpec, positions

__all__ = ["Projection", "attention_pairs", "register_handler", "handler_for"]

NameOf = Callable[[Tensor], str]
Handler = Callable[[nn.Module, str, NameOf], list[PairSpec]]

_HANDLERS: dict[type | str, Handler] = {}


def register_handler(cls: type | str, handler: Handler) -> None:
    """Declare how to find the pairs of modules of class ``cls``.

    ``cls`` is a class or its qualified name (``"package.module.ClassName"``).
    The handler's pairs replace the default element-wise treatment of the module's
    parameters; descendants of a handled module are not visited.
    """
    _HANDLERS[cls] = handler


def handler_for(module: nn.Module) -> Handler | None:
    cls = type(module)
    if cls in _HANDLERS:
        return _HANDLERS[cls]
    return _HANDLERS.get(f"{cls.__module__}.{cls.__qualname__}")


@dataclass(frozen=True)
class Projection:
    """A per-head projection ``x -> x W^T + b`` into ``heads`` blocks of ``d_head``.

    ``weight`` is ``(heads * d_head, d_in)`` (``nn.Linear`` layout) unless
    ``transposed`` (``d_in x heads * d_head``, GPT-2 ``Conv1D``); ``rows`` selects a
    slice of the output features (fused q/k/v weights); ``bias_start`` (default
    ``start``) the slice of the bias, where weights are separate but the bias is fused.
    """

    weight: Tensor
    bias: Tensor | None = None
    start: int = 0
    transposed: bool = False
    bias_start: int | None = None

    def blocks(self, heads: int, d_head: int, name_of: NameOf) -> tuple[Block, ...]:
        width = heads * d_head
        pos = positions(self.weight)
        if self.transposed:
            pos = pos.t()
        pos = pos[self.start : self.start + width]
        out = [Block(name_of(self.weight), pos.reshape(heads, d_head, -1).transpose(1, 2))]
        if self.bias is not None:
            b0 = self.start if self.bias_start is None else self.bias_start
            bpos = positions(self.bias)[b0 : b0 + width]
            out.append(Block(name_of(self.bias), bpos.reshape(heads, 1, d_head)))
        return tuple(out)


def output_blocks(
    weight: Tensor, heads: int, d_head: int, name_of: NameOf, transposed: bool = False
) -> tuple[Block, ...]:
    """``H_i = W_O[:, cols of head i]`` for an output weight ``(d_out, heads * d_head)``."""
    pos = positions(weight)
    if transposed:
        pos = pos.t()
    return (Block(name_of(weight), pos.reshape(pos.shape[0], heads, d_head).transpose(0, 1)),)


def attention_pairs(
    module: str,
    heads: int,
    d_head: int,
    name_of: NameOf,
    query: Projection,
    key: Projection,
    value: Projection,
    output: Tensor,
    output_transposed: bool = False,
    extra_key_rows: tuple[Block, ...] = (),
    extra_value_rows: tuple[Block, ...] = (),
) -> list[PairSpec]:
    """The query/key and value/output pairs of a standard multi-head attention."""
    return [
        PairSpec(
            module,
            "query-key",
            query.blocks(heads, d_head, name_of),
            key.blocks(heads, d_head, name_of) + extra_key_rows,
        ),
        PairSpec(
            module,
            "value-output",
            value.blocks(heads, d_head, name_of) + extra_value_rows,
            output_blocks(output, heads, d_head, name_of, output_transposed),
        ),
    ]


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
        extra_k = (Block(name_of(module.bias_k), positions(module.bias_k).reshape(heads, 1, d_head)),)
        extra_v = (Block(name_of(module.bias_v), positions(module.bias_v).reshape(heads, 1, d_head)),)
    return attention_pairs(
        prefix, heads, d_head, name_of, q, k, v, module.out_proj.weight,
        extra_key_rows=extra_k, extra_value_rows=extra_v,
    )


register_handler(nn.MultiheadAttention, _multihead_attention)


# --- Hugging Face transformers ------------------------------------------------------


def _linear(layer: nn.Module) -> Projection:
    return Projection(layer.weight, layer.bias)


def _hf_self_output(module: nn.Module, prefix: str, name_of: NameOf) -> list[PairSpec]:
    """BERT-family ``XxxAttention``: ``.self`` holds query/key/value, ``.output.dense``
    the output projection (also the ViT layout of transformers 4.x, where the
    self-attention is ``.attention``)."""
    inner = module.self if hasattr(module, "self") else module.attention
    kind = getattr(inner, "position_embedding_type", "absolute")
    if kind not in (None, "absolute"):
        raise NotImplementedError(
            f"{prefix}: position_embedding_type={kind!r} adds position terms to the "
            "query/key scores and breaks their GL(d_head) symmetry; not supported"
        )
    heads = inner.num_attention_heads
    d_head = inner.attention_head_size
    return attention_pairs(
        prefix, heads, d_head, name_of,
        _linear(inner.query), _linear(inner.key), _linear(inner.value),
        module.output.dense.weight,
    )


def _hf_qkvo(module: nn.Module, prefix: str, name_of: NameOf) -> list[PairSpec]:
    """Attention with ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` linear layers and no
    position-dependent rotation of queries and keys (ViT in transformers 5.x)."""
    if not hasattr(module, "q_proj"):
        return _hf_self_output(module, prefix, name_of)
    heads = module.num_attention_heads
    d_head = module.head_dim
    out = module.o_proj if hasattr(module, "o_proj") else module.out_proj
    return attention_pairs(
        prefix, heads, d_head, name_of,
        _linear(module.q_proj), _linear(module.k_proj), _linear(module.v_proj), out.weight,
    )


register_handler("transformers.models.bert.modeling_bert.BertAttention", _hf_self_output)

register_handler("transformers.models.vit.modeling_vit.ViTAttention", _hf_qkvo)
