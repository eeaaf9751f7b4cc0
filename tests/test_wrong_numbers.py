"""No number computed on other data, targets or settings than the user's (issue 37):
each case is what a user did and got a wrong number for, with the number it must be."""

from __future__ import annotations

import pytest
import torch

from geosharp.loading.hfdata import CAUSAL_LM, causal_lm_loss, preflight
from hf_zoo import build as build_hf


def _texts_one_by_one(model, texts):
    """The token-weighted mean next-token loss of each text alone (no padding)."""
    total, count = 0.0, 0
    for ids in texts:
        batch = {"input_ids": ids[None], "attention_mask": torch.ones_like(ids)[None]}
        n = len(ids) - 1
        total += float(causal_lm_loss(model, batch)) * n
        count += n
    return total / count


def _padded(texts, side, pad=0):
    length = max(len(t) for t in texts)
    ids = torch.full((len(texts), length), pad)
    mask = torch.zeros(len(texts), length, dtype=torch.long)
    for i, t in enumerate(texts):
        cut = slice(length - len(t), None) if side == "left" else slice(0, len(t))
        ids[i, cut], mask[i, cut] = t, 1
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_causal_lm_loss_on_any_padding_side_is_the_texts_own(family):
    model, _, _ = build_hf(family)
    model = model.float()  # transformers' float64 eager LLaMA turns a left-padded row to NaN
    g = torch.Generator().manual_seed(0)
    texts = [torch.randint(3, 60, (n,), generator=g) for n in (7, 3, 5)]
    alone = _texts_one_by_one(model, texts)
    for side in ("left", "right"):
        batch = _padded(texts, side)
        with torch.no_grad():
            assert float(causal_lm_loss(model, batch)) == pytest.approx(alone, rel=1e-5), side
        fit = preflight(model, [batch], "texts", CAUSAL_LM)
        assert fit.loss == pytest.approx(alone, rel=1e-5), side
        assert fit.n == sum(len(t) - 1 for t in texts)


def test_resume_refuses_data_or_weights_changed_since(bert_dir, text_csv, tmp_path, capsys):
    """A results file is continued only on the data and the checkpoint it was made on."""
    import shutil

    from geosharp.cli import main

    model, data, out = tmp_path / "model", tmp_path / "data.csv", tmp_path / "out.json"
    shutil.copytree(bert_dir, model)
    shutil.copy(text_csv, data)
    argv = ["measure", str(model), "--data", str(data), "--measures", "adaptive",
            "--n-iters", "1", "--quiet", "--json", str(out), "--resume"]  # fmt: skip
    assert main(argv) == 0
    assert "nothing to resume: a new run starts" in capsys.readouterr().err
    assert main(argv) == 0  # the same data and weights: resumed
    capsys.readouterr()

    with open(data, "a") as f:
        f.write("the film was new,1\n")  # the data file rewritten
    code = main(argv)
    line = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "measured on another data" in line[-1], line
    shutil.copy(text_csv, data)
    weights = next(model.glob("*.safetensors"))
    blob = bytearray(weights.read_bytes())
    blob[-8:] = bytes(8)  # the checkpoint retrained (its last weights moved)
    weights.write_bytes(bytes(blob))
    code = main(argv)
    line = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "measured on another checkpoint" in line[-1], line


@pytest.mark.parametrize("mode", ["I;16", "P", "RGBA", "CMYK", "L", "F"])
def test_images_in_any_mode_read_as_their_8_bit_rgb_copies(mode, tmp_path):
    """16-bit grayscale was clipped at 255 (a ViT at loss 0.0123 measured at 2.43)."""
    import numpy as np
    from PIL import Image

    from geosharp.loading.data import read_images

    g = np.random.default_rng(0)
    rgb = Image.fromarray(g.integers(0, 256, (6, 5, 3), dtype=np.uint8), "RGB")
    gray = np.asarray(rgb.convert("L"))
    if mode == "I;16":
        image = Image.fromarray(gray.astype(np.uint16) * 257)  # 16-bit: 0..65535
        copy = Image.fromarray(gray, "L").convert("RGB")
    elif mode == "F":
        image = Image.fromarray(gray.astype(np.float32) / 255, "F")  # floats in [0, 1]
        copy = Image.fromarray(gray, "L").convert("RGB")
    else:
        image = rgb.convert(mode) if mode != "P" else rgb.quantize(16)
        copy = image.convert("RGB")
    suffix = ".tiff" if mode in ("CMYK", "F") else ".png"
    image.save(tmp_path / f"a{suffix}")
    copy.save(tmp_path / "b.png")
    assert Image.open(tmp_path / f"a{suffix}").mode == image.mode
    a, b = read_images([tmp_path / f"a{suffix}", tmp_path / "b.png"], "RGB")
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_per_head_blocks_of_grouped_query_attention_are_named_key_value_heads():
    """4 query heads on 2 key/value heads: 2 blocks per layer, each a key/value head with
    its 2 query heads, named so (they were called head0, head1)."""
    from geosharp.measures.blocks import head_entries
    from geosharp.symmetry import find_symmetries

    model, inputs, loss = build_hf("llama")
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 2)
    sym = find_symmetries(model, inputs, loss_fn=loss, warn=False)
    assert {p.query_heads for p in sym.pairs} == {2}
    names = sorted(head_entries(sym.pairs))
    assert names == [f"model.layers.{i}.self_attn.kv{k}" for i in (0, 1) for k in (0, 1)]
    bert, inputs, loss = build_hf("bert")
    plain = find_symmetries(bert, inputs, loss_fn=loss).pairs
    assert all(".head" in n for n in head_entries(plain))


def test_one_unperturbed_loss_in_the_table_the_preflight_and_the_json(tmp_path, capsys):
    """Two batches of unequal token counts: the pre-flight loss and every result's
    loss are the same batch-mean (0.8761 beside 0.8771 before)."""
    import json

    from geosharp.cli import main
    from test_usage import _causal_lm

    ckpt = _causal_lm(tmp_path / "gpt2", "gpt2")
    texts = ["the film was good", "a dull plot", "fun", "the actor was superb and the plot"]
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
    argv = ["measure", str(ckpt), "--data", str(tmp_path / "texts.txt"), "--n-iters", "1",
            "--measures", "adaptive", "--batch-size", "3", "--json", "-"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    payload = json.loads(captured.out)
    (row,) = payload["results"]
    assert payload["fit"]["loss"] == pytest.approx(row["loss"], rel=1e-12)
    assert f"unperturbed loss {row['loss']:.4g}" in captured.err


def test_symmetries_loads_the_checkpoint_as_saved(tmp_path, capsys):
    """A BartForCausalLM checkpoint is a decoder with its head: no random encoder listed
    (AutoModel built a whole BartModel)."""
    import transformers as tf

    from geosharp.cli import main

    sizes = dict(encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                 decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)  # fmt: skip
    config = tf.BartConfig(vocab_size=40, d_model=16, max_position_embeddings=32, **sizes)
    tf.BartForCausalLM(config).save_pretrained(tmp_path)
    capsys.readouterr()
    assert main(["symmetries", str(tmp_path), "--no-check"]) == 0
    out = capsys.readouterr().out
    assert "model.decoder.layers.0.self_attn" in out and "encoder.layers" not in out


def test_class_folders_are_read_at_any_depth_and_never_dropped(tmp_path):
    """``apple/batch1/*.png``: apple's images were left out without a word."""
    import numpy as np
    from PIL import Image

    from geosharp.errors import UsageError
    from geosharp.loading.data import image_folder_items

    pixel = Image.fromarray(np.zeros((4, 4, 3), dtype=np.uint8))
    for where in ("apple/batch1/a.png", "apple/batch2/b.png", "pear/c.png"):
        (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
        pixel.save(tmp_path / where)
    items, classes = image_folder_items(tmp_path)
    assert classes == ["apple", "pear"] and [c for _, c in items] == [0, 0, 1]
    (tmp_path / "plum").mkdir()
    with pytest.raises(UsageError, match="plum: a class folder with no images"):
        image_folder_items(tmp_path)


def test_sharpness_under_no_grad_owns_its_gradients():
    """Evaluation code runs under torch.no_grad() or torch.inference_mode(): the
    measure enables what it needs, and the caller's mode is kept; a batch made in
    inference mode is measured as any other."""
    import geosharp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    batch = (torch.randn(8, 4), torch.randint(0, 2, (8,)))

    def loss(m, b):
        return torch.nn.functional.cross_entropy(m(b[0]), b[1])

    free = geosharp.sharpness(model, [batch], loss, "adaptive", 0.05).value
    with torch.no_grad():
        inside = geosharp.sharpness(model, [batch], loss, "adaptive", 0.05).value
        assert not torch.is_grad_enabled()
    assert inside == free > 0
    with torch.inference_mode():  # refused with a message about no_grad, once
        inferred = geosharp.sharpness(model, [batch], loss, "adaptive", 0.05).value
        assert torch.is_inference_mode_enabled()
        made_there = tuple(t.clone() for t in batch)  # inference tensors
    assert inferred == free
    assert geosharp.sharpness(model, [made_there], loss, "adaptive", 0.05).value == free
    trace = geosharp.hessian_trace(model, [batch], loss, "adaptive", n_probes=2).value
    with torch.inference_mode():
        assert geosharp.hessian_trace(model, [batch], loss, "adaptive", n_probes=2).value == trace


def test_images_outside_the_8_and_16_bit_ranges_are_refused(tmp_path):
    """A float image with values up to 300 has no 8-bit copy to match: an error naming
    the file, never a clipped image."""
    import numpy as np
    from PIL import Image

    from geosharp.errors import UsageError
    from geosharp.loading.data import read_images

    Image.fromarray(np.full((4, 4), 300.0, dtype=np.float32), "F").save(tmp_path / "a.tiff")
    with pytest.raises(
        UsageError, match=r"a.tiff: not a readable image .*outside the 8- or 16-bit"
    ):
        read_images([tmp_path / "a.tiff"], "RGB")
