"""75 Hugging Face architecture families, each built tiny from its config.

Every model has 2 layers, width 32, 4 heads (head dimension 8), eager attention, float64
weights and random biases (``transformers`` initialises biases to 0, which would hide a
missing bias row), with weights scaled so that attention is far from uniform. Each
entry says how to build it and what to feed it; :func:`build` returns the model in eval
mode with one batch of inputs and a loss (cross-entropy of its logits against fixed
targets). The table is the coverage test's (``tests/test_coverage.py``) and the source
of ``docs/architectures.md``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

F64 = torch.float64
WIDTH, HEADS, LAYERS, VOCAB = 32, 4, 2, 64


GL8 = (("query-key", "GL", 8), ("value-output", "GL", 8))
ROTARY8 = (("query-key", "rotary", 8), ("value-output", "GL", 8))
NORMED = (("value-output", "GL", 8),)
QK_NORM = (("query-key", "pass through pow"),)  # RMSNorm of queries and keys: no q/k pair


@dataclass(frozen=True)
class Family:
    """An architecture family: ``config`` / ``model`` class names in ``transformers``,
    config keywords, the input kind (``text``, ``seq2seq``, ``image``, ``audio``,
    ``speech``, ``speech-encoder``, ``clip``), and what discovery must find in every
    attention module: ``pairs`` as ``(kind, group, columns)``, ``drops`` as ``(kind,
    words of the reason)`` (pairs that are not symmetries). ``layout``: how the family
    computes attention, for the docs. ``tolerance``: the largest relative change of the
    logits under a symmetry transform, looser (with ``why``) where ``transformers``
    computes part of the attention in float32 even in a float64 model."""

    name: str
    config: str
    model: str
    kwargs: dict = field(default_factory=dict)
    inputs: str = "text"
    pairs: tuple = GL8
    drops: tuple = ()
    layout: str = ""
    tolerance: float = 1e-8
    why: str = ""
    shared: bool = False  # attention modules tied to another's hold its pairs there
    scale: float = 0.3  # of the random weights (smaller where the loss is too curved)


_F32 = "transformers computes {} in float32"


def _enc(**kw) -> dict:
    """BERT-style config keywords."""
    return dict(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=2 * WIDTH, max_position_embeddings=64,
        num_labels=3, **kw,
    )  # fmt: skip


def _dec(**kw) -> dict:
    """LLaMA-style config keywords (grouped-query attention: 2 key/value heads)."""
    base = dict(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=2 * WIDTH,
        max_position_embeddings=64,
    )  # fmt: skip
    base.update(kw)
    return base


def _vision(**kw) -> dict:
    return dict(
        image_size=16, patch_size=8, num_channels=3, hidden_size=WIDTH,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=2 * WIDTH,
        num_labels=3, **kw,
    )  # fmt: skip


def _seq2seq(**kw) -> dict:
    return dict(
        vocab_size=VOCAB, d_model=WIDTH, encoder_layers=LAYERS, decoder_layers=LAYERS,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
        encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH, max_position_embeddings=64,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, **kw,
    )  # fmt: skip


_TEXT_TOWER = dict(
    vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
    num_hidden_layers=LAYERS, num_attention_heads=HEADS, max_position_embeddings=16,
)  # fmt: skip
_VISION_TOWER = dict(
    image_size=16, patch_size=8, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
    num_hidden_layers=LAYERS, num_attention_heads=HEADS,
)  # fmt: skip
_AUDIO = dict(
    hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
    intermediate_size=2 * WIDTH, conv_dim=(16, 16), conv_stride=(4, 4), conv_kernel=(4, 4),
    num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, num_labels=3,
)  # fmt: skip

BERT_LAYOUT = "`query`, `key`, `value`, `output.dense` (BERT)"
QKVO = "`q_proj`, `k_proj`, `v_proj`, `o_proj`"
SEQ2SEQ = "`q_proj`, `k_proj`, `v_proj`, `out_proj`; encoder, decoder and cross-attention"
PARTIAL = (("query-key", "rotary", 4), ("query-key-pass", "GL", 4), ("value-output", "GL", 8))
PARTIAL_INTERLEAVED = (
    ("query-key", "rotary-interleaved", 4), ("query-key-pass", "GL", 4), ("value-output", "GL", 8),
)  # fmt: skip

FAMILIES = [
    # encoders
    Family("bert", "BertConfig", "BertForSequenceClassification", _enc(), layout=BERT_LAYOUT),
    Family("roberta", "RobertaConfig", "RobertaForSequenceClassification", _enc(pad_token_id=1),
           layout=BERT_LAYOUT),
    Family("xlm-roberta", "XLMRobertaConfig", "XLMRobertaForSequenceClassification",
           _enc(pad_token_id=1), layout=BERT_LAYOUT),
    Family("camembert", "CamembertConfig", "CamembertForSequenceClassification",
           _enc(pad_token_id=1), layout=BERT_LAYOUT),
    Family("electra", "ElectraConfig", "ElectraForSequenceClassification", _enc(embedding_size=16),
           layout=BERT_LAYOUT),
    Family("ernie", "ErnieConfig", "ErnieForSequenceClassification", _enc(), layout=BERT_LAYOUT),
    Family("data2vec-text", "Data2VecTextConfig", "Data2VecTextForSequenceClassification",
           _enc(pad_token_id=1), layout=BERT_LAYOUT),
    Family("distilbert", "DistilBertConfig", "DistilBertForSequenceClassification",
           dict(vocab_size=VOCAB, dim=WIDTH, n_layers=LAYERS, n_heads=HEADS, hidden_dim=2 * WIDTH,
                max_position_embeddings=64, num_labels=3),
           layout="`q_lin`, `k_lin`, `v_lin`, `out_lin`"),
    Family("albert", "AlbertConfig", "AlbertForSequenceClassification", _enc(embedding_size=16),
           layout="one layer shared by every layer: one set of pairs"),
    Family("deberta", "DebertaConfig", "DebertaForSequenceClassification",
           _enc(relative_attention=True, pos_att_type=["c2p", "p2c"], max_relative_positions=16),
           layout="fused `in_proj` (q, k, v per head) with `q_bias`, `v_bias`; disentangled "
           "attention: `pos_q_proj` rows join G, `pos_proj` rows join H"),
    Family("deberta-v2", "DebertaV2Config", "DebertaV2ForSequenceClassification",
           _enc(relative_attention=True, pos_att_type=["c2p", "p2c"], max_relative_positions=16,
                position_buckets=8),
           layout="disentangled attention: the position projections `pos_query_proj` (G) and "
           "`pos_key_proj` (H) are rows of the same pair"),
    Family("mpnet", "MPNetConfig", "MPNetForSequenceClassification", _enc(pad_token_id=1),
           layout="`q`, `k`, `v`, `o`; relative position bias added to the scores"),
    Family("funnel", "FunnelConfig", "FunnelForSequenceClassification",
           dict(vocab_size=VOCAB, block_sizes=[1, 1], d_model=WIDTH, n_head=HEADS, d_head=8,
                d_inner=2 * WIDTH, num_labels=3),
           layout="relative-shift attention: `r_w_bias`, `r_r_bias`, `r_s_bias` are rows of G, "
           "`r_kernel` and `seg_embed` rows of H"),
    Family("roformer", "RoFormerConfig", "RoFormerForSequenceClassification",
           _enc(embedding_size=WIDTH), pairs=(("query-key", "rotary-interleaved", 8),
                                            ("value-output", "GL", 8)),
           layout="rotary embeddings on planes (2j, 2j+1)"),
    Family("modernbert", "ModernBertConfig", "ModernBertForSequenceClassification",
           dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, intermediate_size=2 * WIDTH,
                max_position_embeddings=64, num_labels=3, global_attn_every_n_layers=2,
                local_attention=4, pad_token_id=0, attention_bias=True),
           pairs=ROTARY8, layout="fused `Wqkv`; rotary; local and global layers",
           tolerance=1e-6, why=_F32.format("the rotary embedding")),
    # vision
    Family("vit", "ViTConfig", "ViTForImageClassification", _vision(), "image", layout=QKVO),
    Family("deit", "DeiTConfig", "DeiTForImageClassificationWithTeacher", _vision(), "image",
           layout=QKVO),
    Family("dinov2", "Dinov2Config", "Dinov2ForImageClassification",
           {k: v for k, v in _vision().items() if k != "intermediate_size"} | {"mlp_ratio": 2},
           "image", layout=QKVO),
    Family("vit-mae", "ViTMAEConfig", "ViTMAEModel",
           {k: v for k, v in _vision().items() if k != "num_labels"} | {"mask_ratio": 0.0},
           "image", layout=QKVO),
    Family("vit-msn", "ViTMSNConfig", "ViTMSNForImageClassification", _vision(), "image",
           layout=QKVO),
    Family("beit", "BeitConfig", "BeitForImageClassification",
           _vision(use_relative_position_bias=True), "image",
           layout="keys without bias; relative position bias table"),
    Family("data2vec-vision", "Data2VecVisionConfig", "Data2VecVisionForImageClassification",
           _vision(use_relative_position_bias=True), "image",
           layout="keys without bias; relative position bias table"),
    Family("swin", "SwinConfig", "SwinForImageClassification",
           dict(image_size=16, patch_size=2, embed_dim=WIDTH, depths=[2], num_heads=[HEADS],
                window_size=4, num_labels=3), "image",
           layout="shifted-window attention; relative position bias table"),
    Family("swinv2", "Swinv2Config", "Swinv2ForImageClassification",
           dict(image_size=16, patch_size=2, embed_dim=WIDTH, depths=[2], num_heads=[HEADS],
                window_size=4, num_labels=3), "image",
           pairs=(("query-key", "orthogonal", 8), ("value-output", "GL", 8)),
           layout="cosine attention: queries and keys normalised without a weight keep O(8)"),
    Family("clip", "CLIPConfig", "CLIPModel",
           dict(text_config=_TEXT_TOWER, vision_config=_VISION_TOWER, projection_dim=8), "clip",
           layout="text and vision towers"),
    Family("clip-text", "CLIPTextConfig", "CLIPTextModel", dict(_TEXT_TOWER),
           layout="causal text tower"),
    Family("siglip", "SiglipConfig", "SiglipModel",
           dict(text_config=_TEXT_TOWER, vision_config=_VISION_TOWER), "clip",
           layout="towers; the pooling head's `nn.MultiheadAttention` (declared handler)"),
    # decoders
    Family("gpt2", "GPT2Config", "GPT2LMHeadModel",
           dict(vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, n_positions=64),
           layout="fused `Conv1D` `c_attn` (stored in x out)"),
    Family("gpt-neo", "GPTNeoConfig", "GPTNeoForCausalLM",
           dict(vocab_size=VOCAB, hidden_size=WIDTH, num_layers=LAYERS, num_heads=HEADS,
                attention_types=[[["global", "local"], 1]], window_size=4,
                max_position_embeddings=64),
           layout="no score scaling; local and global layers", tolerance=1e-6,
           why=_F32.format("the scores")),
    Family("gpt-neox", "GPTNeoXConfig", "GPTNeoXForCausalLM",
           dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, intermediate_size=2 * WIDTH, rotary_pct=0.5,
                max_position_embeddings=64),
           pairs=PARTIAL, layout="fused `query_key_value` interleaved per head (q, k, v); "
           "partial rotary: rotary on the rotated columns, GL on the rest"),
    Family("gpt-j", "GPTJConfig", "GPTJForCausalLM",
           dict(vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, rotary_dim=4,
                n_positions=64),
           pairs=PARTIAL_INTERLEAVED, layout="partial rotary on planes (2j, 2j+1)",
           tolerance=1e-6, why=_F32.format("the scores")),
    Family("gpt-bigcode", "GPTBigCodeConfig", "GPTBigCodeForCausalLM",
           dict(vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, n_positions=64,
                multi_query=True),
           layout="fused `c_attn`, multi-query: G stacks all 4 query heads"),
    Family("codegen", "CodeGenConfig", "CodeGenForCausalLM",
           dict(vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, rotary_dim=4,
                n_positions=64, n_ctx=64),
           pairs=PARTIAL_INTERLEAVED, layout="fused `qkv_proj` in 4 groups of (q, v, k); partial "
           "rotary on planes (2j, 2j+1)", tolerance=1e-6, why=_F32.format("the scores")),
    Family("opt", "OPTConfig", "OPTForCausalLM",
           dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, ffn_dim=2 * WIDTH, max_position_embeddings=64,
                word_embed_proj_dim=WIDTH), layout=SEQ2SEQ.split(";")[0]),
    Family("bloom", "BloomConfig", "BloomForCausalLM",
           dict(vocab_size=VOCAB, hidden_size=WIDTH, n_layer=LAYERS, n_head=HEADS),
           layout="fused `query_key_value` interleaved per head; ALiBi added to the scores"),
    Family("falcon", "FalconConfig", "FalconForCausalLM",
           dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, new_decoder_architecture=True, num_kv_heads=2,
                bias=True, alibi=False),
           pairs=ROTARY8, layout="fused `query_key_value` grouped by key/value head; bias added "
           "before the rotary embedding"),
    Family("mpt", "MptConfig", "MptForCausalLM",
           dict(vocab_size=VOCAB, d_model=WIDTH, n_heads=HEADS, n_layers=LAYERS,
                expansion_ratio=2, max_seq_len=64, no_bias=False),
           layout="fused `Wqkv`; ALiBi"),
    Family("llama", "LlamaConfig", "LlamaForCausalLM", _dec(attention_bias=True), pairs=ROTARY8,
           layout=QKVO + " with biases; grouped-query (2 query heads per key/value head)"),
    Family("llama-mqa", "LlamaConfig", "LlamaForCausalLM", _dec(num_key_value_heads=1),
           pairs=ROTARY8, layout="multi-query: one key/value head"),
    Family("mistral", "MistralConfig", "MistralForCausalLM", _dec(), pairs=ROTARY8, layout=QKVO),
    Family("mixtral", "MixtralConfig", "MixtralForCausalLM",
           _dec(num_local_experts=2, num_experts_per_tok=1), pairs=ROTARY8,
           layout="Mistral's attention; mixture-of-experts MLP (no pairs)"),
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", _dec(), pairs=ROTARY8,
           layout=QKVO + " with biases"),
    Family("qwen2-moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
           _dec(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                shared_expert_intermediate_size=16), pairs=ROTARY8,
           layout="mixture-of-experts MLP (no pairs)"),
    Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", _dec(head_dim=8), pairs=NORMED,
           drops=QK_NORM, layout="`q_norm`, `k_norm` normalise each head"),
    Family("gemma", "GemmaConfig", "GemmaForCausalLM", _dec(head_dim=8), pairs=ROTARY8,
           layout=QKVO),
    Family("gemma2", "Gemma2Config", "Gemma2ForCausalLM", _dec(head_dim=8), pairs=ROTARY8,
           layout="soft-capped scores (a function of the scores: no change)"),
    Family("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", _dec(head_dim=8, sliding_window=4),
           pairs=NORMED, drops=QK_NORM, layout="`q_norm`, `k_norm`; sliding-window layers"),
    Family("olmo", "OlmoConfig", "OlmoForCausalLM", _dec(), pairs=ROTARY8, layout=QKVO),
    Family("olmo-clip-qkv", "OlmoConfig", "OlmoForCausalLM", _dec(clip_qkv=0.5), pairs=(),
           drops=(("query-key", "pass through clamp"), ("value-output", "pass through clamp")),
           layout="`clip_qkv` clamps queries, keys and values: no symmetry"),
    Family("olmo2", "Olmo2Config", "Olmo2ForCausalLM", _dec(), pairs=NORMED, drops=QK_NORM,
           layout="`q_norm`, `k_norm` over all heads"),
    Family("phi", "PhiConfig", "PhiForCausalLM", _dec(partial_rotary_factor=0.5), pairs=PARTIAL,
           layout="partial rotary (rotate half)"),
    Family("phi3", "Phi3Config", "Phi3ForCausalLM", _dec(pad_token_id=0), pairs=ROTARY8,
           layout="fused `qkv_proj` (q, k, v), grouped-query"),
    Family("stablelm", "StableLmConfig", "StableLmForCausalLM", _dec(partial_rotary_factor=0.5),
           pairs=PARTIAL, layout="partial rotary (rotate half)"),
    Family("cohere", "CohereConfig", "CohereForCausalLM", _dec(),
           pairs=(("query-key", "rotary-interleaved", 8), ("value-output", "GL", 8)),
           layout="rotary on planes (2j, 2j+1)", tolerance=1e-6,
           why=_F32.format("the rotary embedding")),
    Family("starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", _dec(), pairs=ROTARY8,
           layout=QKVO + " with biases"),
    Family("granite", "GraniteConfig", "GraniteForCausalLM", _dec(), pairs=ROTARY8,
           layout="LLaMA's attention with a score multiplier"),
    Family("biogpt", "BioGptConfig", "BioGptForCausalLM", _enc(), layout=SEQ2SEQ.split(";")[0]),
    Family("xglm", "XGLMConfig", "XGLMForCausalLM",
           dict(vocab_size=VOCAB, d_model=WIDTH, num_layers=LAYERS, attention_heads=HEADS,
                ffn_dim=2 * WIDTH, max_position_embeddings=64), layout=SEQ2SEQ.split(";")[0]),
    # encoder-decoders and speech
    Family("t5", "T5Config", "T5ForConditionalGeneration",
           dict(vocab_size=VOCAB, d_model=WIDTH, d_kv=8, d_ff=2 * WIDTH, num_layers=LAYERS,
                num_heads=HEADS, decoder_start_token_id=0, relative_attention_num_buckets=8),
           "seq2seq", layout="`q`, `k`, `v`, `o` without biases; relative position bias; "
           "encoder, decoder and cross-attention"),
    Family("t5-encoder", "T5Config", "T5EncoderModel",
           dict(vocab_size=VOCAB, d_model=WIDTH, d_kv=8, d_ff=2 * WIDTH, num_layers=LAYERS,
                num_heads=HEADS, relative_attention_num_buckets=8), layout="T5's encoder"),
    Family("bart", "BartConfig", "BartForConditionalGeneration", _seq2seq(), "seq2seq",
           layout=SEQ2SEQ),
    Family("mbart", "MBartConfig", "MBartForConditionalGeneration", _seq2seq(), "seq2seq",
           layout=SEQ2SEQ),
    Family("marian", "MarianConfig", "MarianMTModel", _seq2seq(), "seq2seq", layout=SEQ2SEQ),
    Family("pegasus", "PegasusConfig", "PegasusForConditionalGeneration", _seq2seq(), "seq2seq",
           layout=SEQ2SEQ),
    Family("whisper", "WhisperConfig", "WhisperForConditionalGeneration",
           _seq2seq(num_mel_bins=8, max_source_positions=8, max_target_positions=16), "speech",
           layout="keys without bias; encoder, decoder and cross-attention"),
    Family("whisper-encoder", "WhisperConfig", "WhisperForAudioClassification",
           _seq2seq(num_mel_bins=8, max_source_positions=8, max_target_positions=16,
                    num_labels=3), "speech-encoder", layout="Whisper's encoder"),
    Family("wav2vec2", "Wav2Vec2Config", "Wav2Vec2ForSequenceClassification", dict(_AUDIO),
           "audio", layout=SEQ2SEQ.split(";")[0] + " over a convolutional feature encoder"),
    Family("hubert", "HubertConfig", "HubertForSequenceClassification", dict(_AUDIO), "audio",
           layout=SEQ2SEQ.split(";")[0] + " over a convolutional feature encoder"),
    # 2026 LLMs: latent attention, mixtures of experts, state-space hybrids
    Family("deepseek-v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
           dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=HEADS, intermediate_size=64,
                moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=12,
                qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                max_position_embeddings=64, n_group=2, topk_group=1),
           pairs=(("query-key-pass", "GL", 8), ("query-key", "rotary", 4),
                  ("value-output", "GL", 8)),
           layout="multi-head latent attention: GL per head across the low-rank projections, "
           "one rotary pair of every head's rotary part with the shared key; keys built "
           "with `new_empty` and `copy_`; a router kept in float32", tolerance=1e-6,
           why=_F32.format("the attention weights")),
    Family("jamba", "JambaConfig", "JambaForCausalLM",
           _dec(num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
                expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4, mamba_d_conv=2,
                mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False),
           layout="Mamba layers (no pairs: the scan's operands pass through a filter and "
           "SiLU) beside attention layers; mixture-of-experts MLPs", tolerance=1e-6,
           why=_F32.format("the attention weights")),
    Family("granite-moe-hybrid", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
           _dec(num_local_experts=2, num_experts_per_tok=1, layer_types=["mamba", "attention"],
                mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                mamba_expand=2, mamba_d_conv=2, shared_intermediate_size=32),
           layout="Granite-4.0: Mamba-2 (its scan read as attention of tainted operands: no "
           "pairs) and mixture-of-experts layers before attention"),
    Family("zamba2", "Zamba2Config", "Zamba2ForCausalLM",
           dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=4,
                num_attention_heads=HEADS, num_key_value_heads=HEADS, intermediate_size=64,
                mamba_d_state=8, mamba_headdim=8, n_mamba_heads=8, mamba_ngroups=1,
                layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
                hybrid_layer_ids=[1, 3], use_shared_attention_adapter=True, adapter_rank=4,
                num_mem_blocks=1, use_mem_rope=True, max_position_embeddings=64,
                attention_head_dim=16),
           pairs=(("query-key", "rotary", 16), ("value-output", "GL", 16)), shared=True,
           scale=0.15,
           layout="one attention block shared across depth, a LoRA adapter per call on q, k "
           "and v: one pair per head acting on every call's adapter", tolerance=1e-6,
           why=_F32.format("the attention weights")),
    Family("nllb-moe", "NllbMoeConfig", "NllbMoeForConditionalGeneration",
           _seq2seq(num_experts=2, expert_capacity=8, encoder_sparse_step=2,
                    decoder_sparse_step=2), "seq2seq",
           layout=SEQ2SEQ + "; top-2 routers that cast themselves to float32"),
    Family("switch", "SwitchTransformersConfig", "SwitchTransformersForConditionalGeneration",
           dict(vocab_size=VOCAB, d_model=WIDTH, d_kv=8, d_ff=2 * WIDTH, num_layers=LAYERS,
                num_decoder_layers=LAYERS, num_heads=HEADS, num_experts=2, expert_capacity=8,
                encoder_sparse_step=2, decoder_sparse_step=2, decoder_start_token_id=0,
                relative_attention_num_buckets=8), "seq2seq",
           layout="T5's attention; top-1 routers that cast themselves to float32",
           scale=0.2),
]  # fmt: skip
LABELLED = [
    Family("longformer", "LongformerConfig", "LongformerForSequenceClassification",
           {**_enc(pad_token_id=1, attention_window=[4, 4]), "max_position_embeddings": 80},
           pairs=(("query-key", "GL", 8), ("query-key-2", "GL", 8)),
           drops=(("value-output", "features mixed with an activation or a constant"),),
           layout="sliding-window and global attention: both query/key pairs found; the "
           "values padded with -1 before their sliding windows mix them (a constant the "
           "probabilities then multiply by zero), and summed with the global attention's: "
           "no value/output pair is established"),
]  # fmt: skip
"""Families whose attention is understood in part, the rest said (not exact)."""
BY_NAME = {f.name: f for f in FAMILIES + LABELLED}


def build(family: Family | str, seed: int = 0, scale: float | None = None):
    """``(model, inputs, loss_fn)``: the family's tiny float64 model (eval mode), a batch
    of 2 inputs and ``loss_fn(model, inputs)``."""
    import transformers as tf

    family = BY_NAME[family] if isinstance(family, str) else family
    config = getattr(tf, family.config)(**family.kwargs)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # the grouped matmul has no float64 kernel
    for sub in ("text_config", "vision_config"):
        if getattr(config, sub, None) is not None:
            getattr(config, sub)._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        model = getattr(tf, family.model)(config).to(F64).eval()
        _randomise(model, family.scale if scale is None else scale)
    inputs = _inputs(family, config, seed)
    return model, inputs, _loss


def _randomise(model: nn.Module, scale: float) -> None:
    """Matrices ~ N(0, scale^2), biases ~ N(0, 0.1^2), other vectors (norm scales)
    moved by N(0, 0.1^2): attention far from uniform, biases that matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, scale)
            elif name.endswith("bias") or "bias" in name.rsplit(".", 1)[-1]:
                p.normal_(0.0, 0.1)
            else:
                p.add_(0.1 * torch.randn_like(p))


def _inputs(family: Family, config, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 7), generator=g)
    if family.inputs == "text":
        return {"input_ids": ids}
    if family.inputs == "seq2seq":
        return {"input_ids": ids, "decoder_input_ids": torch.randint(3, VOCAB, (2, 5), generator=g)}
    if family.inputs == "image":
        pixels = {"pixel_values": torch.randn(2, 3, 16, 16, generator=g, dtype=F64)}
        if family.name == "vit-mae":  # fixed: the patch shuffle is random otherwise
            pixels["noise"] = torch.rand(2, 4, generator=g, dtype=F64)
        return pixels
    if family.inputs == "clip":
        return {"input_ids": ids, "pixel_values": torch.randn(2, 3, 16, 16, generator=g, dtype=F64)}
    if family.inputs == "audio":
        return {"input_values": torch.randn(2, 160, generator=g, dtype=F64)}
    frames = 2 * config.max_source_positions
    features = torch.randn(2, config.num_mel_bins, frames, generator=g, dtype=F64)
    if family.inputs == "speech":
        return {"input_features": features, "decoder_input_ids": ids[:, :5]}
    return {"input_features": features}


def logits_of(out) -> torch.Tensor:
    """The model's main floating output."""
    for name in ("logits", "logits_per_image", "last_hidden_state"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    return out[0]


def _loss(model: nn.Module, inputs: dict) -> torch.Tensor:
    """Cross-entropy of the logits against fixed targets (class ``i mod C`` at row ``i``)."""
    logits = logits_of(model(**inputs))
    flat = logits.reshape(-1, logits.shape[-1])
    targets = torch.arange(flat.shape[0]) % flat.shape[-1]
    return F.cross_entropy(flat, targets)


def _groups(pairs: tuple, kind: str) -> str:
    """The group of one role, e.g. ``GL(8)``, ``rotary(4) x GL(4)``, or ``none``."""
    parts = [f"{group}({h})" for k, group, h in pairs if k == kind or k == f"{kind}-pass"]
    return " x ".join(parts) if parts else "none"


def render_table() -> str:
    """The coverage table of ``docs/architectures.md``: per family, its class, the group
    of each pair role in every attention module, and how it computes attention."""
    lines = [
        "| family | `transformers` class | query/key | value/output | layout |",
        "|---|---|---|---|---|",
    ]
    for f in FAMILIES:
        note = f.layout + (f" (logits to {f.tolerance:g}: {f.why})" if f.why else "")
        lines.append(
            f"| {f.name} | `{f.model}` | {_groups(f.pairs, 'query-key')} | "
            f"{_groups(f.pairs, 'value-output')} | {note} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # rewrite the table in docs/architectures.md
    import re
    from pathlib import Path

    path = Path(__file__).parent.parent / "docs" / "architectures.md"
    text = path.read_text()
    begin, end = "<!-- coverage table: python tests/hf_zoo.py -->", "<!-- end of table -->"
    table = f"{begin}\n{render_table()}\n{end}"
    if begin in text:
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: table, text, flags=re.S)
    else:
        text += "\n" + table + "\n"
    path.write_text(text)
    print(f"wrote the table of {len(FAMILIES)} families into {path}")
