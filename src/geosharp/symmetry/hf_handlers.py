"""Handlers for Hugging Face ``transformers`` attention modules (checked against 5.x).

Registered by qualified class name, so ``transformers`` is not imported. Each handler
verifies the structure it relies on (plain ``nn.Linear`` / ``Conv1D`` projections,
head counts and widths) and claims only the symmetries the module's ``forward``
really has (MATH.md section 1):

==========================================  ==========================================
layout                                      classes
==========================================  ==========================================
``.self.{query,key,value}``,                BERT, RoBERTa, XLM-RoBERTa, CamemBERT,
``.output.dense``                           ELECTRA
``{q,k,v}_proj``, ``o_proj``/``out_proj``   ViT, DeiT, DINOv2, ViT-MAE, ViT-MSN, CLIP
                                            (vision and text), SigLIP
``{q,k,v,out}_lin``                         DistilBERT
fused ``Conv1D`` ``c_attn`` (``in x out``)  GPT-2 (also cross-attention ``q_attn``)
``{q,k,v,o}_proj`` + RoPE (+ GQA)           LLaMA, Mistral, Qwen2, Gemma, Gemma2, OLMo;
                                            Qwen3, OLMo2 (value/output only)
==========================================  ==========================================

Rotary models: the query/key pair has the ``"rotary"`` group (complex scalars on the
planes ``(j, j + d_head/2)`` of the "rotate half" layout), value/output keeps
``GL(d_head)``. The query/key pair is dropped where queries and keys are normalised
(``q_norm``/``k_norm``: Qwen3, OLMo2), where only part of each head is rotated
(``partial_rotary_factor < 1``), and both pairs where q/k/v are clipped element-wise
(OLMo ``clip_qkv``).
"""

from __future__ import annotations

from torch import nn

from .handlers import Projection, attention_pairs, linear_projection, plain_linear, warn_skipped
from .pairs import PairSpec
from .registry import NameOf, nested_pairs, register_handler

__all__: list[str] = []

_T = "transformers.models."


def _linears(prefix: str, **layers: nn.Module) -> dict[str, Projection | None]:
    return {
        role: linear_projection(layer) if plain_linear(layer, prefix, role) else None
        for role, layer in layers.items()
    }


def _qkvo(
    module: nn.Module,
    prefix: str,
    name_of: NameOf,
    q: nn.Module,
    k: nn.Module,
    v: nn.Module,
    o: nn.Module,
    heads: int,
    d_head: int,
    kv_heads: int | None = None,
    query_key: bool = True,
    value_output: bool = True,
    query_key_group: str = "GL",
) -> list[PairSpec]:
    """Separate query/key/value/output ``nn.Linear`` layers; adapters nested inside
    (LoRA) contribute their own pairs."""
    kv_heads = heads if kv_heads is None else kv_heads
    widths = (q.out_features, k.out_features, v.out_features, o.in_features)
    if widths != (heads * d_head, kv_heads * d_head, kv_heads * d_head, heads * d_head):
        raise ValueError(
            f"{prefix}: projection widths {widths} do not match {heads} heads, "
            f"{kv_heads} key/value heads of size {d_head}"
        )
    p = _linears(prefix, query=q, key=k, value=v, output=o)
    output = p["output"].weight if p["output"] is not None else None
    pairs = attention_pairs(
        prefix,
        heads,
        d_head,
        name_of,
        p["query"] if query_key else None,
        p["key"] if query_key else None,
        p["value"] if value_output else None,
        output if value_output else None,
        kv_heads=kv_heads,
        query_key_group=query_key_group,
    )
    return pairs + nested_pairs(module, prefix, name_of)


# --- BERT family: XxxAttention with .self (query/key/value) and .output.dense ---------


def _bert_attention(module: nn.Module, prefix: str, name_of: NameOf) -> list[PairSpec]:
    """``XxxAttention``: ``.self`` holds query/key/value (self- or cross-attention: keys
    and values may read the encoder's states, the pairs are the same), ``.output.dense``
    the output projection. Relative position embeddings (``relative_key``, transformers
    4.x) add query-dependent terms to the scores: no query/key pair then."""
    inner = module.self
    kind = getattr(inner, "position_embedding_type", None) or "absolute"
    heads, d_head = inner.num_attention_heads, inner.attention_head_size
    return _qkvo(
        module,
        prefix,
        name_of,
        inner.query,
        inner.key,
        inner.value,
        module.output.dense,
        heads,
        d_head,
        query_key=kind == "absolute",
    )


for _name in (
    "bert.modeling_bert.BertAttention",
    "roberta.modeling_roberta.RobertaAttention",
    "xlm_roberta.modeling_xlm_roberta.XLMRobertaAttention",
    "camembert.modeling_camembert.CamembertAttention",
    "electra.modeling_electra.ElectraAttention",
):
    register_handler(_T + _name, _bert_attention)


# --- ViT family: q_proj/k_proj/v_proj/o_proj (transformers 5.x) -----------------------


def _vit_attention(module: nn.Module, prefix: str, name_of: NameOf) -> list[PairSpec]:
    """``ViTAttention`` and its copies: ``{q,k,v,o}_proj`` with ``num_attention_heads``
    and ``head_dim``; no position terms in the scores."""
    return _qkvo(
        module,
        prefix,
        name_of,
        module.q_proj,
        module.k_proj,
        module.v_proj,
        module.o_proj,
        module.num_attention_heads,
        module.head_dim,
    )


for _name in (
    "vit.modeling_vit.ViTAttention",
    "deit.modeling_deit.DeiTAttention",
    "dinov2.modeling_dinov2.Dinov2Attention",
    "vit_mae.modeling_vit_mae.ViTMAEAttention",
    "vit_msn.modeling_vit_msn.ViTMSNAttention",
):
    register_handler(_T + _name, _vit_attention)


def _clip_attention(module: nn.Module, prefix: str, name_of: NameOf) -> list[PairSpec]:
    """``CLIPAttention`` (vision and text towers; the text tower's causal mask does not
    touch the symmetry) and ``SiglipAttention``: ``{q,k,v,out}_proj``, ``num_heads``."""
    return _qkvo(
        module,
        prefix,
        name_of,
        module.q_proj,
        module.k_proj,
        module.v_proj,
        module.out_proj,
        module.num_heads,
        module.head_dim,
    )


for _name in ("clip.modeling_clip.CLIPAttention", "siglip.modeling_siglip.SiglipAttention"):
    register_handler(_T + _name, _clip_attention)


def _distilbert_attention(module: nn.Module, prefix: str, name_of: NameOf) -> list[PairSpec]:
    """``DistilBertSelfAttention``: ``{q,k,v,out}_lin``, ``n_heads``."""
    return _qkvo(
        module,
        prefix,
        name_of,
        module.q_lin,
        module.k_lin,
        module.v_lin,
        module.out_lin,
        module.n_heads,
        module.attention_head_size,
    )


register_handler(
    _T + "distilbert.modeling_distilbert.DistilBertSelfAttention", _distilbert_attention
)


# --- GPT-2: fused Conv1D ---------------------------------------------------------------


def _is_conv1d(layer: nn.Module) -> bool:
    cls = type(layer)
    return (
        f"{cls.__module__}.{cls.__qualname__}" == "transformers.pytorch_utils.Conv1D"
        and isinstance(layer.weight, nn.Parameter)
    )


def _gpt2_attention(module: nn.Module, prefix: str, name_of: NameOf) -> list[PairSpec]:
    """``GPT2Attention``: ``Conv1D`` layers compute ``x W + b`` with ``W`` stored
    ``in x out``; ``c_attn`` holds (q | k | v), each ``heads x head_dim`` wide (for
    cross-attention ``c_attn`` holds (k | v) and ``q_attn`` the queries); ``c_proj`` is
    the output. The score scale (``1/sqrt(d)``, ``1/(layer+1)``) is a constant."""
    heads, d_head, width = module.num_heads, module.head_dim, module.embed_dim
    layers = {"c_attn": module.c_attn, "c_proj": module.c_proj}
    if module.is_cross_attention:
        layers["q_attn"] = module.q_attn
    wrapped = [role for role, layer in layers.items() if not _is_conv1d(layer)]
    if wrapped:
        for role in wrapped:
            warn_skipped(layers[role], prefix, role)
        return nested_pairs(module, prefix, name_of)
    c_attn = module.c_attn
    fused = c_attn.weight
    if module.is_cross_attention:
        q = Projection(module.q_attn.weight, module.q_attn.bias, transposed=True)
        k, v = (Projection(fused, c_attn.bias, start=i * width, transposed=True) for i in range(2))
    else:
        q, k, v = (
            Projection(fused, c_attn.bias, start=i * width, transposed=True) for i in range(3)
        )
    return attention_pairs(
        prefix, heads, d_head, name_of, q, k, v, module.c_proj.weight, output_transposed=True
    )


register_handler(_T + "gpt2.modeling_gpt2.GPT2Attention", _gpt2_attention)


# --- LLaMA family: rotary position embeddings, grouped-query attention ----------------


def _normalises(module: nn.Module, name: str) -> bool:
    layer = getattr(module, name, None)
    return layer is not None and not isinstance(layer, nn.Identity)


def _rotary_attention(module: nn.Module, prefix: str, name_of: NameOf) -> list[PairSpec]:
    """``LlamaAttention`` and its copies: ``{q,k,v,o}_proj``, ``num_key_value_groups``
    query heads per key/value head, RoPE in the rotate-half layout applied to queries
    and keys (``position_embeddings``). Query/key: ``"rotary"`` subgroup; value/output:
    ``GL(head_dim)``."""
    config = module.config
    heads = config.num_attention_heads
    kv_heads = heads // module.num_key_value_groups
    rope = getattr(config, "rope_parameters", None) or {}
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    partial = float(partial if partial is not None else 1.0)
    normalised = _normalises(module, "q_norm") or _normalises(module, "k_norm")
    clipped = getattr(config, "clip_qkv", None) is not None
    return _qkvo(
        module,
        prefix,
        name_of,
        module.q_proj,
        module.k_proj,
        module.v_proj,
        module.o_proj,
        heads,
        module.head_dim,
        kv_heads=kv_heads,
        query_key=not (normalised or clipped or partial != 1.0 or module.head_dim % 2),
        value_output=not clipped,
        query_key_group="rotary",
    )


for _name in (
    "llama.modeling_llama.LlamaAttention",
    "mistral.modeling_mistral.MistralAttention",
    "qwen2.modeling_qwen2.Qwen2Attention",
    "qwen3.modeling_qwen3.Qwen3Attention",
    "gemma.modeling_gemma.GemmaAttention",
    "gemma2.modeling_gemma2.Gemma2Attention",
    "olmo.modeling_olmo.OlmoAttention",
    "olmo2.modeling_olmo2.Olmo2Attention",
):
    register_handler(_T + _name, _rotary_attention)


def _nested_only(module: nn.Module, prefix: str, name_of: NameOf) -> list[PairSpec]:
    """A container whose only symmetric part is a handled submodule (SigLIP's pooling
    head: a learned probe attends with an ``nn.MultiheadAttention``)."""
    return nested_pairs(module, prefix, name_of)


register_handler(_T + "siglip.modeling_siglip.SiglipMultiheadAttentionPoolingHead", _nested_only)
