"""No number computed on other data, targets or settings than the user's (issue 37):
each case is what a user did and got a wrong number for, with the number it must be."""

from __future__ import annotations

import pytest
import torch

from geosharp.hfdata import CAUSAL_LM, causal_lm_loss, preflight
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

    from geosharp.data import read_images

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
