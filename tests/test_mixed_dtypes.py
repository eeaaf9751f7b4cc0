"""Models whose parameters come in several dtypes, as their owners save and load them:
DeepSeek-V3 loaded in bfloat16 keeps its router in float32 (``_keep_in_fp32_modules``),
T5 loaded in float16 keeps ``wo`` in float32, NLLB-MoE and Switch Transformers cast their
router to float32 in their first forward, even in a float64 model. Every measure runs
on them, perturbs every parameter in a buffer of float32 or wider, and leaves the model
as it was (dtypes included)."""

from __future__ import annotations

import collections
import json
import warnings

import pytest
import torch
from torch.nn import functional as F

import geosharp
from geosharp.training.optim import GeodesicSAM
from test_soundness import assert_unchanged, snapshot

tf = pytest.importorskip("transformers")
VOCAB = 64


def _deepseek(**kw):
    return tf.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=16,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        q_lora_rank=16, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8,
        v_head_dim=8, max_position_embeddings=64, n_group=2, topk_group=1, **kw,
    )  # fmt: skip


CONFIGS = {
    "deepseek-v3": (_deepseek, "DeepseekV3ForCausalLM", torch.bfloat16),
    "t5": (
        lambda: tf.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=1,
            num_heads=4,
            decoder_start_token_id=0,
            relative_attention_num_buckets=8,
        ),
        "T5ForConditionalGeneration",
        torch.float16,
    ),
    "nllb-moe": (
        lambda: tf.NllbMoeConfig(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            num_experts=2,
            expert_capacity=8,
            encoder_sparse_step=2,
            decoder_sparse_step=2,
            max_position_embeddings=64,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=2,
        ),
        "NllbMoeForConditionalGeneration",
        torch.float64,
    ),
}


def _loaded(name, tmp_path):
    """The model saved, then loaded in its dtype as its owners load it; a batch; a loss
    in float32 from the logits."""
    config_of, cls, dtype = CONFIGS[name]
    config = config_of()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        getattr(tf, cls)(config).save_pretrained(tmp_path / name)
        model = getattr(tf, cls).from_pretrained(tmp_path / name, dtype=dtype).eval()
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids}
    if "ConditionalGeneration" in cls:
        batch["decoder_input_ids"] = ids[:, :4]

    def loss_fn(model, b):
        logits = model(**b).logits.float()
        flat = logits.reshape(-1, logits.shape[-1])
        return F.cross_entropy(flat, torch.arange(flat.shape[0]) % VOCAB)

    return model, batch, loss_fn


def _dtypes(model):
    return collections.Counter(str(p.dtype).removeprefix("torch.") for p in model.parameters())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_measure_runs_in_the_models_own_dtypes(name, tmp_path):
    model, batch, loss_fn = _loaded(name, tmp_path)
    with torch.no_grad():  # a router casts itself to float32 in the first forward
        loss_fn(model, batch)
    assert len(_dtypes(model)) == 2, _dtypes(model)
    before = snapshot(model)
    widths = []

    def seen(event, i, iterate):
        widths.append(iterate.xi.dtype)

    values = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for measure in ("adaptive", "geodesic-inv", "adaptive-attn", "geodesic-inv-attn"):
            result = geosharp.sharpness(
                model, [batch], loss_fn, measure, estimator=geosharp.WorstCase(n_iters=2),
                callback=seen,
            )  # fmt: skip
            values[measure] = result.value
            assert result.value > 0 and result.floor > 0, (measure, result.settings)
            assert_unchanged(model, before)
        blocks = geosharp.block_sharpness(
            model, [batch], loss_fn, "adaptive", estimator=geosharp.WorstCase(n_iters=1),
            per="module",
        )  # fmt: skip
        trace = geosharp.hessian_trace(model, [batch], loss_fn, "geodesic-inv", n_probes=2)
    assert_unchanged(model, before)
    # every parameter perturbed in float32 or wider
    assert widths and all(torch.finfo(w).bits >= 32 for w in widths)
    assert all(b.value >= 0 for b in blocks.blocks.values()) and trace.value == trace.value


def test_a_router_cast_by_its_own_forward_is_put_back(tmp_path):
    """NLLB-MoE in float64: a measure's first forward casts the routers to float32 (the
    model's own code); the measure runs in those dtypes, and the model comes back as
    it was, its routers in float64."""
    model, batch, loss_fn = _loaded("nllb-moe", tmp_path)
    assert _dtypes(model) == {"float64": sum(1 for _ in model.parameters())}
    before = snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = geosharp.sharpness(
            model, [batch], loss_fn, "adaptive", estimator=geosharp.WorstCase(n_iters=2)
        )
    assert_unchanged(model, before)
    assert "in float32, as their modules" in result.settings["precision"]
    assert result.settings["dtype"] == "float64"


def test_geodesic_sam_steps_a_float64_model_with_float32_routers(tmp_path):
    model, batch, loss_fn = _loaded("nllb-moe", tmp_path)
    with torch.no_grad():
        loss_fn(model, batch)
    optimizer = GeodesicSAM(model, torch.optim.SGD, rho=0.05, lr=0.01)
    routers = [p for p in model.parameters() if p.dtype == torch.float32]
    kept = [p.detach().clone() for p in routers]
    loss_fn(model, batch).backward()
    optimizer.first_step(zero_grad=True)
    loss_fn(model, batch).backward()
    optimizer.second_step(zero_grad=True)
    assert all(p.dtype == torch.float32 for p in routers)
    assert any(not torch.equal(p, k) for p, k in zip(routers, kept))  # trained


def test_the_command_line_measures_a_checkpoint_saved_with_a_float32_router(tmp_path, capsys):
    """``geosharp measure --dtype auto`` on DeepSeek-V3 saved in bfloat16: loaded as its
    owners load it (the router in float32), measured."""
    from geosharp.cli import main
    from test_usage import _causal_lm

    ckpt = _causal_lm(tmp_path / "deepseek", "deepseek-v3")
    (tmp_path / "texts.txt").write_text("the film was good\na dull plot\nfun\nthe plot\n")
    argv = ["measure", str(ckpt), "--data", str(tmp_path / "texts.txt"), "--n-iters", "2",
            "--batch-size", "2", "--measures", "adaptive,geodesic-inv", "--dtype", "auto",
            "--json", "-", "--quiet"]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    for result in out["results"]:
        assert result["value"] > 0
        assert result["settings"]["dtype"] == "float32"
