"""Model coverage: discovery, exact invariance and geodesic-sharpness invariance for every
supported attention layout, on tiny random float64 models built locally.

For each architecture: the pairs found (number, kind, group, shape); a random transform
in each pair's claimed group (condition number 100) leaves the model's output unchanged
(``check_symmetries``); geodesic sharpness (``inv`` and ``mix``, 10 Auto-PGD steps from
``xi = 0``) agrees before and after ``reparameterize`` within 1%, while adaptive
sharpness changes.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import geosharp
from geosharp.geometry import Geometry
from geosharp.symmetry import (
    Block,
    PairSpec,
    Symmetries,
    check_symmetries,
    find_symmetries,
    reparameterize,
)
from geosharp.symmetry.groups import random_matrices
from zoo import (
    BERT,
    CLIP_TEXT,
    CLIP_VISION,
    GL,
    LLAMA,
    QK_BERT,
    VIT,
    VO_BERT,
    Attention,
    TinyTimmViT,
    _clip,
    _cls_loss,
    _gpt2,
    _ids,
    _labels,
    _pixels,
    _ready,
)

tf = pytest.importorskip("transformers")

F64 = torch.float64
COND = 100.0
GEODESIC_TOL = 1e-2  # relative, geodesic before vs after reparameterisation
ADAPTIVE_MIN = 5e-2  # relative change adaptive sharpness must show


RHO = {"inv": 0.1, "mix": 0.01}


def _pairs_of(symmetries, module):
    return [(p.kind, p.group, p.shape) for p in symmetries.pairs if p.module == module]


def test_discovery_and_exact_invariance(architecture):
    case = architecture.case()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing unrecognised, nothing skipped
        symmetries = find_symmetries(case.model, case.inputs)
    assert symmetries.unrecognized == [] and symmetries.complete
    assert _pairs_of(symmetries, architecture.module) == architecture.pairs
    assert len(symmetries.pairs) == architecture.n_pairs
    check = check_symmetries(case.model, case.inputs, cond=COND)
    assert check.ok, str(check)
    assert check.max_rel_change < 1e-12


def _sharpness(model, batch, loss, geometry, metric):
    measure = Geometry.named(geometry, metric=metric)
    return geosharp.sharpness(
        model, [batch], loss, measure, RHO[metric], geosharp.WorstCase(n_iters=10)
    ).value


def test_geodesic_sharpness_is_invariant(architecture):
    case = architecture.case()
    (batch,) = case.batches
    model, loss = case.model, case.loss_fn
    moved = copy.deepcopy(model)
    reparameterize(moved, cond=COND, seed=1, batch=case.inputs)
    for metric in ("inv", "mix"):
        before = _sharpness(model, batch, loss, "geodesic", metric)
        after = _sharpness(moved, batch, loss, "geodesic", metric)
        assert before > 0
        assert abs(after - before) <= GEODESIC_TOL * abs(before), (metric, before, after)
    before = _sharpness(model, batch, loss, "adaptive", "inv")
    after = _sharpness(moved, batch, loss, "adaptive", "inv")
    assert abs(after - before) > ADAPTIVE_MIN * abs(before), (before, after)


def test_clip_covers_both_towers():
    model = _ready(_clip())
    modules = {p.module for p in find_symmetries(model).pairs}
    assert modules == {
        f"{tower}.encoder.layers.{i}.self_attn"
        for tower in ("text_model", "vision_model")
        for i in range(2)
    }


def test_gpt2_cross_attention():
    config = tf.GPT2Config(
        vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32, add_cross_attention=True
    )
    model = _ready(tf.GPT2LMHeadModel(config))
    # Without encoder states the cross-attention does not run: its parameters take no
    # part in the loss, and no pair of it is claimed.
    alone = find_symmetries(model, warn=False)
    assert not any(p.module.endswith("crossattention") for p in alone.pairs)
    batch = {"input_ids": _ids(0), "encoder_hidden_states": torch.randn(3, 5, 16, dtype=F64)}
    symmetries = find_symmetries(model, batch)
    # The decoder queries (q_attn) and encoder keys/values (c_attn holds k | v).
    assert _pairs_of(symmetries, "transformer.h.0.crossattention") == [QK_BERT, VO_BERT]
    assert check_symmetries(model, batch, cond=COND).ok


# --- more transformers classes with the same layouts ------------------------------------------

MORE = {
    "bert": (lambda: tf.BertModel(tf.BertConfig(**BERT)), "encoder.layer.0.attention"),
    "xlm-roberta": (
        lambda: tf.XLMRobertaModel(tf.XLMRobertaConfig(**BERT, pad_token_id=1)),
        "encoder.layer.0.attention",
    ),
    "camembert": (
        lambda: tf.CamembertModel(tf.CamembertConfig(**BERT, pad_token_id=1)),
        "encoder.layer.0.attention",
    ),
    "vit-mae": (
        lambda: tf.ViTMAEModel(
            tf.ViTMAEConfig(**{k: v for k, v in VIT.items() if k != "num_labels"}, mask_ratio=0.0)
        ),
        "layers.0.attention",
    ),
    "electra": (
        lambda: tf.ElectraModel(tf.ElectraConfig(**BERT, embedding_size=16)),
        "encoder.layer.0.attention",
    ),
    "dinov2": (
        lambda: tf.Dinov2Model(
            tf.Dinov2Config(**{k: v for k, v in VIT.items() if k != "num_labels"}, mlp_ratio=2)
        ),
        "encoder.layer.0.attention",
    ),
    "vit-msn": (lambda: tf.ViTMSNModel(tf.ViTMSNConfig(**VIT)), "layers.0.attention"),
    "clip-vision": (
        lambda: tf.CLIPVisionModel(tf.CLIPVisionConfig(**CLIP_VISION)),
        "encoder.layers.0.self_attn",
    ),
    "clip-text": (
        lambda: tf.CLIPTextModel(tf.CLIPTextConfig(**CLIP_TEXT)),
        "encoder.layers.0.self_attn",
    ),
    "siglip": (
        lambda: tf.SiglipModel(tf.SiglipConfig(text_config=CLIP_TEXT, vision_config=CLIP_VISION)),
        "vision_model.head.attention",
    ),
}


def _more_batch(name):
    if name in ("dinov2", "vit-msn", "clip-vision"):
        return {"pixel_values": _pixels()}
    if name == "vit-mae":  # fixed noise: the patch shuffle is random otherwise
        return {"pixel_values": _pixels(), "noise": torch.rand(3, 4, dtype=F64)}
    if name == "siglip":
        return {"input_ids": _ids(), "pixel_values": _pixels()}
    return {"input_ids": _ids()}


@pytest.mark.parametrize("name", list(MORE))
def test_more_bert_and_vit_layouts(name):
    build, module = MORE[name]
    torch.manual_seed(0)
    model = _ready(build())
    symmetries = find_symmetries(model)
    assert symmetries.unrecognized == []
    assert [kind for kind, _, _ in _pairs_of(symmetries, module)] == ["query-key", "value-output"]
    assert check_symmetries(model, _more_batch(name), cond=COND).ok


ROTARY = {
    # name: (config class, model class, extra config, kinds found)
    "mistral": ("MistralConfig", "MistralForCausalLM", {}, ["query-key", "value-output"]),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, ["query-key", "value-output"]),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}, ["query-key", "value-output"]),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8}, ["query-key", "value-output"]),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}, ["query-key", "value-output"]),
    # q_norm / k_norm normalise queries and keys with a learned weight: only scalings
    # of the query/key pair are left, which the element-wise geometry respects.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}, ["value-output"]),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, ["value-output"]),
    # clip_qkv clamps q, k and v element-wise: no symmetry at all.
    "olmo-clip-qkv": ("OlmoConfig", "OlmoForCausalLM", {"clip_qkv": 0.5}, []),
    # multi-query attention: one key/value head shared by all 4 query heads.
    "llama-mqa": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"num_key_value_heads": 1},
        ["query-key", "value-output"],
    ),
}


def _learned_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Query/key norms as training leaves them: weights no longer all one."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("name", list(ROTARY))
def test_rotary_family(name):
    config_cls, model_cls, extra, kinds = ROTARY[name]
    config = getattr(tf, config_cls)(**{**LLAMA, **extra})
    torch.manual_seed(0)
    model = _learned_norms(_ready(getattr(tf, model_cls)(config)))
    symmetries = find_symmetries(model)
    found = _pairs_of(symmetries, "model.layers.0.self_attn")
    assert [kind for kind, _, _ in found] == kinds
    for kind, group, _ in found:
        assert group == ("rotary" if kind == "query-key" else "GL")
    check = check_symmetries(model, {"input_ids": _ids(0)}, cond=COND)
    assert check.ok if kinds else check.status == "nothing to check"


@pytest.mark.parametrize("name", ["qwen3", "olmo2"])
def test_query_key_norms_at_their_initial_weight_keep_a_rotation_per_plane(name):
    """Norms whose weight is all one normalise without a weight: the query/key pair
    keeps a rotation on each rotary plane (rotary and orthogonal); a learned weight
    leaves only scalings (``test_rotary_family``), which the drop says exactly."""
    config_cls, model_cls, extra, _ = ROTARY[name]
    config = getattr(tf, config_cls)(**{**LLAMA, **extra})
    torch.manual_seed(0)
    model = _ready(getattr(tf, model_cls)(config))
    found = _pairs_of(find_symmetries(model), "model.layers.0.self_attn")
    assert [(kind, group) for kind, group, _ in found] == [
        ("query-key", "rotary-orthogonal"), ("value-output", "GL"),
    ]  # fmt: skip
    # their norms compute in float32: the logits move by float32's round-off
    assert check_symmetries(model, {"input_ids": _ids(0)}, cond=COND, tolerance=1e-6).ok
    learned = find_symmetries(_learned_norms(model))
    (drop,) = [d for d in learned.dropped if d.module == "model.layers.0.self_attn"]
    assert drop.exact and "not a symmetry of rotary(8) or rotary-orthogonal(8)" in drop.reason


def test_llama_mqa_stacks_all_query_heads():
    config = tf.LlamaConfig(**{**LLAMA, "num_key_value_heads": 1})
    model = _ready(tf.LlamaForCausalLM(config))
    found = _pairs_of(find_symmetries(model), "model.layers.0.self_attn")
    # One key/value head: G stacks the 4 query blocks (4 x 32 rows), H the 4 output blocks.
    assert found == [
        ("query-key", "rotary", (1, 128, 32, 8)),
        ("value-output", GL, (1, 32, 128, 8)),
    ]


def test_gqa_needs_the_shared_transform():
    """A value head read by two query heads: transforming it with only one of the two
    output blocks is not a symmetry, the stacked pair is needed."""
    torch.manual_seed(0)
    model = _ready(tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA)))
    symmetries = find_symmetries(model)
    spec = next(p for p in symmetries.pairs if p.kind == "value-output")
    (out_block,) = spec.h_blocks  # (2 value heads, 2 x 32 rows, 8): [Ho_2g; Ho_2g+1]
    first_only = PairSpec(
        spec.module,
        "value-output",
        spec.g_blocks,
        (Block(out_block.param, out_block.index[:, :32]),),
    )
    alone = Symmetries([first_only], symmetries.parameters)
    assert not check_symmetries(model, {"input_ids": _ids(0)}, alone, cond=COND).ok
    assert check_symmetries(
        model, {"input_ids": _ids(0)}, Symmetries([spec], symmetries.parameters), cond=COND
    ).ok


# --- timm-style variants ------------------------------------------------------------------


def test_timm_qk_norm_keeps_only_value_output():
    model = _ready(TinyTimmViT(qk_norm=True))
    symmetries = find_symmetries(model)
    assert _pairs_of(symmetries, "blocks.0.attn") == [VO_BERT]
    batch = {"pixel_values": _pixels()}
    assert check_symmetries(model, batch["pixel_values"], cond=COND).ok
    # The dropped query/key pair really is broken by the normalisation.
    plain = find_symmetries(_ready(TinyTimmViT()))
    qk = [p for p in plain.pairs if p.kind == "query-key"]
    broken = Symmetries(qk, symmetries.parameters)
    assert not check_symmetries(model, batch["pixel_values"], broken, cond=COND).ok


def test_timm_scale_norm_keeps_only_query_key():
    model = _ready(TinyTimmViT(scale_norm=True))
    assert _pairs_of(find_symmetries(model), "blocks.0.attn") == [QK_BERT]
    assert check_symmetries(model, _pixels(), cond=COND).ok


def test_attention_named_differently_is_flagged():
    class MyAttention(Attention):
        pass

    model = TinyTimmViT()
    model.blocks[0]["attn"].__class__ = MyAttention
    with pytest.warns(UserWarning, match="does not understand"):
        symmetries = find_symmetries(model)  # no batch: only declared layouts apply
    assert symmetries.unrecognized == [""]  # nothing traced: said, whatever the names
    assert "NOT RECOGNISED" in symmetries.summary()
    assert "no forward pass ran" in symmetries.summary().split("NOT RECOGNISED")[1]


def test_attention_named_differently_is_found_with_a_batch():
    """The same renamed module, traced on a batch: its pairs come from what it computes."""

    class MyAttention(Attention):
        pass

    model = _ready(TinyTimmViT())
    model.blocks[0]["attn"].__class__ = MyAttention
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        symmetries = find_symmetries(model, _pixels())
    assert _pairs_of(symmetries, "blocks.0.attn") == [QK_BERT, VO_BERT]
    assert symmetries.unrecognized == []


def test_gpt_neox_fused_interleaved_partial_rotary():
    """GPT-NeoX: a fused query_key_value whose heads interleave (q | k | v), rotary on a
    quarter of each head: rotary(2) on those columns, GL(6) on the rest."""
    config = tf.GPTNeoXConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, rotary_pct=0.25, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = _ready(tf.GPTNeoXForCausalLM(config))
    symmetries = find_symmetries(model, {"input_ids": _ids(0)})
    assert _pairs_of(symmetries, "gpt_neox.layers.0.attention") == [
        ("query-key", "rotary", (2, 17, 17, 2)),
        ("query-key-pass", GL, (2, 17, 17, 6)),
        ("value-output", GL, (2, 17, 16, 8)),
    ]
    assert all(v.ok for v in symmetries.verified.values()) and len(symmetries.verified) == 3
    assert check_symmetries(model, {"input_ids": _ids(0)}, cond=COND).ok


# --- RoPE: the subgroup is needed ---------------------------------------------------------


def test_llama_full_gl_on_query_key_changes_the_output():
    torch.manual_seed(0)
    model = _ready(tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA)))
    symmetries = find_symmetries(model)
    qk = [p for p in symmetries.pairs if p.kind == "query-key"]
    generator = torch.Generator().manual_seed(0)
    transforms = {p.name: random_matrices(p.shape[0], p.shape[3], COND, generator) for p in qk}
    batch = {"input_ids": _ids(0)}
    reference = model(**batch).logits
    moved = copy.deepcopy(model)
    wrong = Symmetries(qk, symmetries.parameters)  # GL on rotary columns: not a symmetry
    reparameterize(moved, wrong, transforms=transforms, unverified=True)
    change = (moved(**batch).logits - reference).abs().max() / reference.abs().max()
    assert change > 1e-3
    # ... while a transform in the rotary group does not.
    moved = copy.deepcopy(model)
    reparameterize(moved, symmetries, cond=COND, batch=batch)
    assert (moved(**batch).logits - reference).abs().max() <= 1e-6 * reference.abs().max()


# --- LoRA (peft) ------------------------------------------------------------------------------


def _lora(model, **config):
    peft = pytest.importorskip("peft")
    settings = dict(r=4, lora_alpha=8, init_lora_weights=False)
    settings.update(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return _ready(peft.get_peft_model(model, peft.LoraConfig(**settings)))


def _roberta_lora(**config):
    torch.manual_seed(0)
    base = tf.RobertaForSequenceClassification(
        tf.RobertaConfig(**BERT, pad_token_id=1, num_labels=3)
    )
    return _lora(base, **{"target_modules": ["query", "value"], **config})


def test_lora_pairs_and_invariance():
    model = _roberta_lora()
    symmetries = find_symmetries(model)
    lora = [p for p in symmetries.pairs if p.kind == "lora[default]"]
    # One GL(4) pair per adapted layer: G = B (16 x 4), H = A^T (16 x 4).
    assert len(lora) == 4 and all(p.shape == (1, 16, 16, 4) and p.group == GL for p in lora)
    # The adapted query/value layers are no longer plain: their attention pairs are left
    # out (the base weights are frozen, so nothing is lost for the measure).
    assert {p.kind for p in symmetries.pairs} == {"lora[default]"}
    batch = {"input_ids": _ids(), "labels": _labels()}
    assert check_symmetries(model, {"input_ids": batch["input_ids"]}, cond=COND).ok

    moved = copy.deepcopy(model)
    reparameterize(moved, symmetries, cond=COND, seed=1)
    for metric in ("inv", "mix"):
        before = _sharpness(model, batch, _cls_loss, "geodesic", metric)
        after = _sharpness(moved, batch, _cls_loss, "geodesic", metric)
        assert before > 0
        assert abs(after - before) <= GEODESIC_TOL * before
    before = _sharpness(model, batch, _cls_loss, "adaptive", "inv")
    after = _sharpness(moved, batch, _cls_loss, "adaptive", "inv")
    assert abs(after - before) > ADAPTIVE_MIN * before


def test_lora_trainable_base_warns_and_keeps_other_pairs():
    model = _roberta_lora(target_modules=["query"])
    for p in model.parameters():
        p.requires_grad_(True)
    with pytest.warns(UserWarning, match="does not understand"):
        symmetries = find_symmetries(model)
    (drop,) = [d for d in symmetries.dropped if d.module.endswith("layer.0.attention")]
    assert (
        drop.kind == "query-key" and not drop.exact and "base weights are trainable" in drop.reason
    )
    kinds = sorted(p.kind for p in symmetries.pairs if p.module.endswith("layer.0.attention"))
    assert kinds == ["value-output"]  # query/key needs the adapted query: left out
    assert check_symmetries(model, {"input_ids": _ids()}, symmetries, cond=COND).ok


def test_dora_and_gpt2_conv1d_lora():
    torch.manual_seed(0)
    llama = _lora(
        tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA)),
        target_modules=["q_proj", "v_proj"],
        use_dora=True,
    )
    symmetries = find_symmetries(llama)
    # q_proj and v_proj carry adapters: only the LoRA pairs (DoRA: the same GL(r)). The
    # attention pairs are left out by design, with their base weights frozen: nothing
    # is ignored (DoRA's trainable magnitude is an adapter's, not a base weight).
    assert {p.kind for p in symmetries.pairs} == {"lora[default]"}
    assert not symmetries.ignored and symmetries.dropped
    assert all(d.exact and "adapters" in d.reason for d in symmetries.dropped)
    assert check_symmetries(llama, {"input_ids": _ids(0)}, cond=COND).ok

    gpt2 = _lora(_gpt2(), target_modules=["c_attn"], fan_in_fan_out=True)
    symmetries = find_symmetries(gpt2)
    assert [p.shape for p in symmetries.pairs] == [(1, 48, 16, 4)] * 2
    assert check_symmetries(gpt2, {"input_ids": _ids(0)}, cond=COND).ok


def test_lora_embedding_and_conv():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 6)
            self.conv = nn.Conv2d(3, 6, 3, padding=1)
            self.out = nn.Linear(12, 2)

        def forward(self, ids, image):
            a = self.emb(ids).mean(1)
            b = self.conv(image).mean((2, 3))
            return self.out(torch.cat([a, b], 1))

    torch.manual_seed(0)
    model = _lora(Net(), target_modules=["emb", "conv"], r=2)
    symmetries = find_symmetries(model)
    shapes = {p.module.rsplit(".", 1)[-1]: p.shape for p in symmetries.pairs}
    assert shapes == {"emb": (1, 6, 20, 2), "conv": (1, 6, 27, 2)}
    batch = (torch.randint(0, 20, (2, 5)), torch.randn(2, 3, 5, 5, dtype=F64))
    assert check_symmetries(model, batch, cond=COND).ok


# --- summary ----------------------------------------------------------------------------------


def test_summary_lists_groups_and_elementwise_parameters():
    model = _ready(tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA)))
    text = find_symmetries(model).summary()
    assert "rotary(8) x 2 heads" in text and "GL(8) x 2 heads" in text
    assert "2 query heads share each key/value head" in text
    assert "model.layers.0: mlp.gate_proj.weight" in text
    assert "NOT RECOGNISED" not in text


def test_timm_with_lora_on_qkv():
    model = _lora(TinyTimmViT(), target_modules=["qkv"], r=2)
    symmetries = find_symmetries(model, _pixels())
    assert symmetries.unrecognized == []
    # qkv carries an adapter: only its LoRA pair (G = B: 48 x 2, H = A^T: 16 x 2).
    assert [(p.kind, p.shape) for p in symmetries.pairs] == [("lora[default]", (1, 48, 16, 2))] * 2
    assert check_symmetries(model, _pixels(), cond=COND).ok
