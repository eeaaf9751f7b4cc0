"""The command line on locally saved checkpoints (nothing downloaded), and the demo."""

import json

import pytest
import torch

from geosharp.cli import main

WORDS = "good bad great awful film movie plot actor fun dull boring superb the a is was".split()


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    path = tmp_path_factory.mktemp("bert")
    vocab = path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]))
    tokenizer = BertTokenizerFast(vocab_file=str(vocab))
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(WORDS) + 5,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=2,
        initializer_range=0.2,
        max_position_embeddings=32,
    )
    BertForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    from transformers import ViTConfig, ViTForImageClassification

    path = tmp_path_factory.mktemp("vit")
    torch.manual_seed(0)
    config = ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=1,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=10,
    )
    ViTForImageClassification(config).save_pretrained(path)
    return path


def test_symmetries_command(bert_dir, capsys):
    assert main(["symmetries", str(bert_dir)]) == 0
    out = capsys.readouterr().out
    assert "encoder.layer.0.attention" in out and "query-key" in out
    assert "self-check OK" in out


def test_measure_text_csv_json(bert_dir, tmp_path, capsys):
    data = tmp_path / "data.csv"
    rows = ["text,label"] + [f"the film was {w},{i % 2}" for i, w in enumerate(WORDS * 2)]
    data.write_text("\n".join(rows))
    out_json = tmp_path / "out.json"
    code = main(
        [
            "measure",
            str(bert_dir),
            "--data",
            str(data),
            "--n-points",
            "16",
            "--batch-size",
            "8",
            "--n-iters",
            "3",
            "--json",
            str(out_json),
            "--measures",
            "adaptive,adaptive-linf,geodesic-mix",
            "--rho",
            "adaptive=0.02,geodesic-mix=0.001",
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "adaptive-linf" in table and "geodesic-mix" in table
    payload = json.loads(out_json.read_text())
    rows = {r["measure"]: r for r in payload["results"]}
    assert rows["adaptive"]["rho"] == 0.02 and rows["geodesic-mix"]["rho"] == 0.001
    assert rows["adaptive-linf"]["rho"] == 0.005  # default
    assert all(len(r["per_batch"]) == 2 for r in rows.values())


def test_measure_vision_builtin_digits(vit_dir, capsys):
    code = main(
        [
            "measure",
            str(vit_dir),
            "--data",
            "digits",
            "--n-points",
            "32",
            "--batch-size",
            "16",
            "--n-iters",
            "2",
            "--measures",
            "geodesic-inv",
            "--json",
            "-",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    payload = json.loads(out[out.index("{") :])
    assert payload["results"][0]["geometry"] == "geodesic[inv]"


def test_measure_errors(bert_dir, tmp_path):
    with pytest.raises(SystemExit, match="image data but"):
        main(["measure", str(bert_dir), "--data", "digits"])
    with pytest.raises(FileNotFoundError, match="not a Hugging Face checkpoint"):
        main(["measure", str(tmp_path), "--data", "digits"])
    with pytest.raises(ValueError, match="unknown measure"):
        main(["measure", str(bert_dir), "--data", "digits", "--measures", "sharp"])


def test_demo_quick(capsys):
    from geosharp.demo import run_demo

    lines = []
    assert run_demo(epochs=2, n_iters=3, print_fn=lines.append) == 0
    table = {
        line.split()[0] + (" " + line.split()[1] if line.startswith("geodesic") else ""): line
        for line in lines
        if line.startswith(("adaptive", "geodesic", "euclidean"))
    }
    assert "yes" in table["geodesic inv"] and "yes" in table["geodesic mix"]
    assert "NO" in table["adaptive"]
