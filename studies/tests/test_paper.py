"""Paper-scale loaders on tiny random models saved in the same layouts, with fake data."""

from __future__ import annotations

import math

import pytest
import torch

import geosharp
from geosharp.measures import sharpness
from geosharp_studies import paper


def _tiny_clip_vision(seed=0):
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    config = CLIPVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=16,
        projection_dim=8,
        initializer_factor=5.0,
    )
    torch.manual_seed(seed)
    return CLIPVisionModelWithProjection(config).eval()


def _to_openai(vision) -> dict:
    """Hugging Face -> OpenAI-CLIP names, written independently of the loader."""
    s = vision.state_dict()
    out = {
        "visual.conv1.weight": s["vision_model.embeddings.patch_embedding.weight"],
        "visual.class_embedding": s["vision_model.embeddings.class_embedding"],
        "visual.positional_embedding": s["vision_model.embeddings.position_embedding.weight"],
        "visual.ln_pre.weight": s["vision_model.pre_layrnorm.weight"],
        "visual.ln_pre.bias": s["vision_model.pre_layrnorm.bias"],
        "visual.ln_post.weight": s["vision_model.post_layernorm.weight"],
        "visual.ln_post.bias": s["vision_model.post_layernorm.bias"],
        "visual.proj": s["visual_projection.weight"].t(),
    }
    for i in range(vision.config.num_hidden_layers):
        a, h = f"visual.transformer.resblocks.{i}.", f"vision_model.encoder.layers.{i}."
        for p in ("weight", "bias"):
            out[a + f"attn.in_proj_{p}"] = torch.cat(
                [s[h + f"self_attn.{n}_proj.{p}"] for n in ("q", "k", "v")]
            )
            out[a + f"attn.out_proj.{p}"] = s[h + f"self_attn.out_proj.{p}"]
            out[a + f"ln_1.{p}"] = s[h + f"layer_norm1.{p}"]
            out[a + f"ln_2.{p}"] = s[h + f"layer_norm2.{p}"]
            out[a + f"mlp.c_fc.{p}"] = s[h + f"mlp.fc1.{p}"]
            out[a + f"mlp.c_proj.{p}"] = s[h + f"mlp.fc2.{p}"]
    return out


@pytest.fixture()
def fake_imagenet(tmp_path):
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    root = tmp_path / "imagenet"
    for c in ("n001", "n002", "n003"):
        (root / c).mkdir(parents=True)
        for k in range(2):
            w, h = 40 + 8 * k, 36
            pixels = torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8)
            Image.fromarray(pixels.numpy()).save(root / c / f"{k}.png")
    return root


def test_clip_layouts_agree_and_measure(tmp_path, fake_imagenet):
    from safetensors.torch import save_file

    vision = _tiny_clip_vision()
    head = torch.nn.Linear(8, 3)
    # Hugging Face layout
    hf_dir = tmp_path / "hf" / "finetune-0"
    vision.save_pretrained(hf_dir)
    save_file(
        {k: v.contiguous() for k, v in head.state_dict().items()},
        hf_dir / "classification_head.safetensors",
    )
    # model-soups layout (OpenAI names, "model." prefix, classification head)
    state = {f"model.{k}": v for k, v in _to_openai(vision).items()}
    state.update({f"classification_head.{k}": v for k, v in head.state_dict().items()})
    pt = tmp_path / "hf" / "model_1.pt"
    torch.save(state, pt)

    assert paper.list_checkpoints(tmp_path / "hf") == [hf_dir, pt]
    a = paper.load_clip_finetune(hf_dir)
    b = paper.load_clip_finetune(pt, config=vision.config)
    batches = list(paper.imagenet_batches(fake_imagenet, batch_size=4, size=32))
    assert [len(y) for _, y in batches] == [4, 2]
    assert batches[0][0].shape == (4, 3, 32, 32)
    x = batches[0][0]
    with torch.no_grad():
        ref = head(torch.nn.functional.normalize(vision(pixel_values=x).image_embeds, dim=-1))
        torch.testing.assert_close(a(x), ref)
        torch.testing.assert_close(b(x), ref)
    subset = list(paper.imagenet_batches(fake_imagenet, batch_size=8, n_images=4, size=32))
    assert sum(len(y) for _, y in subset) == 4
    for name in ("adaptive", "geodesic-inv"):
        res = sharpness(
            b,
            batches,
            paper.clip_loss,
            rho=0.05,
            measure=name,
            estimator=geosharp.WorstCase(n_iters=1),
        )
        assert math.isfinite(res.value) and len(res.per_batch) == 2


def test_bert_mnli(tmp_path):
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from geosharp.loading.hf import classification_loss, resolve_checkpoint

    tok = AutoTokenizer.from_pretrained(resolve_checkpoint("minilm"), local_files_only=True)
    config = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
        num_labels=3,
        id2label={0: "entailment", 1: "neutral", 2: "contradiction"},
        label2id={"entailment": 0, "neutral": 1, "contradiction": 2},
    )
    torch.manual_seed(0)
    model_dir = tmp_path / "mnli" / "bert-0"
    BertForSequenceClassification(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    tsv = tmp_path / "dev_matched.tsv"
    lines = ["index\tsentence1\tsentence2\tgold_label"]
    labels = ["entailment", "neutral", "contradiction", "-", "neutral"]
    for i, lab in enumerate(labels):
        lines.append(f"{i}\tA man plays a guitar number {i}.\tSomeone makes music.\t{lab}")
    tsv.write_text("\n".join(lines) + "\n")
    rows = paper.read_mnli(tsv)
    assert len(rows) == 4  # "-" (no gold label) dropped
    model = paper.load_bert_mnli(model_dir)
    batches = paper.mnli_batches(model_dir, rows, batch_size=2)
    assert batches[0]["labels"].tolist() == [0, 1]  # the config's label2id
    assert batches[1]["labels"].tolist() == [2, 1]
    assert "token_type_ids" in batches[0]
    for name in ("adaptive", "geodesic-mix"):
        res = sharpness(
            model,
            batches,
            classification_loss,
            rho=0.05,
            measure=name,
            estimator=geosharp.WorstCase(n_iters=1),
        )
        assert math.isfinite(res.value)


def test_clip_full_model_directory(tmp_path):
    from safetensors.torch import save_file
    from transformers import CLIPConfig, CLIPModel

    vision = _tiny_clip_vision()
    text = dict(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=16,
    )
    text.update(bos_token_id=0, eos_token_id=1, pad_token_id=1)
    config = CLIPConfig(text_config=text, vision_config=vision.config.to_dict(), projection_dim=8)
    torch.manual_seed(1)
    full = CLIPModel(config).eval()
    head = torch.nn.Linear(8, 3)
    full.save_pretrained(tmp_path / "clip")
    save_file(
        {k: v.contiguous() for k, v in head.state_dict().items()},
        tmp_path / "clip" / "classification_head.safetensors",
    )
    model = paper.load_clip_finetune(tmp_path / "clip")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = head(
            torch.nn.functional.normalize(
                full.get_image_features(pixel_values=x).pooler_output, dim=-1
            )
        )
        torch.testing.assert_close(model(x), ref)


def _bert_driver_setup(tmp_path):
    """Three tiny BERT-MNLI fine-tunes, six MNLI rows, gaps: the driver's arguments."""
    import json

    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from geosharp.loading.hf import resolve_checkpoint

    tok = AutoTokenizer.from_pretrained(resolve_checkpoint("minilm"), local_files_only=True)
    config = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=64,
        num_labels=3,
    )
    for i in range(3):
        torch.manual_seed(i)
        BertForSequenceClassification(config).save_pretrained(tmp_path / "ft" / f"bert-{i}")
        tok.save_pretrained(tmp_path / "ft" / f"bert-{i}")
    data = tmp_path / "mnli.jsonl"
    rows = [
        {"premise": f"A dog runs {i}.", "hypothesis": "An animal moves.", "label": i % 3}
        for i in range(6)
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    gaps = tmp_path / "gaps.csv"
    gaps.write_text("checkpoint,gap\nbert-0,0.1\nbert-1,0.3\nbert-2,0.2\n")
    out = tmp_path / "out"
    argv = ["study", "paper", "bert", "--checkpoints", str(tmp_path / "ft"), "--data", str(data)]
    argv += ["--gaps", str(gaps), "--out", str(out), "--n-points", "4", "--batch-size", "2"]
    argv += ["--n-iters", "1", "--measures", "adaptive", "geodesic-inv", "--rho-factors", "1"]
    argv += ["--n-boot", "50", "--label-order", "entailment,neutral,contradiction"]
    return argv


def test_paper_driver_bert(tmp_path):
    import json

    from geosharp.cli import main

    argv = _bert_driver_setup(tmp_path)
    out = tmp_path / "out"
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_models"] == 3
    for measure in ("adaptive", "geodesic-inv"):
        (entry,) = summary["taus"][measure].values()
        assert -1 <= entry["estimate"] <= 1
    record = json.loads((out / "measures" / "bert-0.json").read_text())
    assert record["complete"] and len(record["measures"]["adaptive"]["0.05"]["per_batch"]) == 2


def test_paper_driver_under_torchrun(tmp_path, monkeypatch):
    """Two gloo ranks share the three checkpoints and write the files a single process
    (this one) writes."""
    from geosharp.cli import main
    from launch import one_thread, run_python

    argv = _bert_driver_setup(tmp_path)
    single = tmp_path / "out"
    shared = tmp_path / "shared"
    monkeypatch.chdir(tmp_path)
    with one_thread():
        assert main(argv) == 0
    run_python(["-m", "geosharp.cli", *argv, "--out", str(shared)], 2, cwd=tmp_path)
    for name in ("summary.json", *(f"measures/bert-{i}.json" for i in range(3))):
        assert (single / name).read_bytes() == (shared / name).read_bytes()


@pytest.mark.parametrize(
    "setting, n_points, batch_size", [("clip", 2048, 256), ("bert", 1024, 128)]
)
def test_drivers_default_to_the_paper_protocol(
    setting, n_points, batch_size, tmp_path, monkeypatch
):
    from geosharp.cli import main
    from geosharp_studies import paper

    seen = {}

    def fake_run_paper(args):
        seen.update(n_points=args.n_points, batch_size=args.batch_size)
        return {"taus": {}, "n_models": 0}

    monkeypatch.setattr(paper, "run_paper", fake_run_paper)
    argv = ["study", "paper", setting, "--checkpoints", str(tmp_path), "--data", str(tmp_path)]
    assert main(argv) == 0
    assert seen == dict(n_points=n_points, batch_size=batch_size)
    assert main([*argv, "--n-points", "8", "--batch-size", "4"]) == 0
    assert seen == dict(n_points=8, batch_size=4)


def _one_line(capsys, code):
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    return err[0]


def test_paper_driver_refuses_what_would_give_a_wrong_number(tmp_path, capsys):
    """The driver's traps, each a one-line error before measuring: a fine-tune without
    tokenizer files or without its trained head, a config without label names and no
    --label-order, gaps that match no checkpoint, a rerun with other settings on the
    same --out; a measure added on a rerun is measured (no KeyError)."""
    import json
    import shutil

    from geosharp.cli import main

    argv = _bert_driver_setup(tmp_path)
    capsys.readouterr()
    ft = tmp_path / "ft"
    label_order = argv.index("--label-order")
    no_order = argv[:label_order] + argv[label_order + 2 :]
    assert "--label-order" in _one_line(capsys, main(no_order))
    gaps = tmp_path / "bad_gaps.csv"
    gaps.write_text("checkpoint,gap\nbert-0,0.1\nbert-1,0.3\nbert-9,0.2\n")
    bad = [*argv, "--gaps", str(gaps)]
    line = _one_line(capsys, main(bad))
    assert "no gap for ['bert-2']" in line and "['bert-9']" in line

    assert main([*argv, "--measures", "adaptive"]) == 0
    out = argv[argv.index("--out") + 1]
    assert "other settings (n_iters: 1 there, 2 now)" in _one_line(
        capsys, main([*argv, "--n-iters", "2"])
    )
    assert main(argv) == 0  # geodesic-inv added to the records, no KeyError
    record = json.loads((tmp_path / "out" / "measures" / "bert-0.json").read_text())
    assert set(record["measures"]) == {"adaptive", "geodesic-inv"}
    assert record["settings"]["n_iters"] == 1 and out

    for name, damage, expected in [
        ("no_tokenizer", ("vocab.txt", "tokenizer.json", "tokenizer_config.json"), "tokenizer"),
        ("no_head", None, "no trained classifier"),
    ]:
        broken = tmp_path / name
        shutil.copytree(ft, broken / "ft")
        if damage:
            for f in damage:
                (broken / "ft" / "bert-0" / f).unlink(missing_ok=True)
        else:
            from safetensors.torch import load_file, save_file

            weights = broken / "ft" / "bert-0" / "model.safetensors"
            state = {k: v for k, v in load_file(weights).items() if "classifier" not in k}
            save_file(state, weights, metadata={"format": "pt"})
        args = [*argv, "--checkpoints", str(broken / "ft"), "--out", str(broken / "out")]
        assert expected in _one_line(capsys, main(args)), name


def test_mnli_files_as_their_owners_wrote_them(tmp_path):
    """TSV with premise/hypothesis columns and capitalised labels; JSONL with Hugging
    Face's integer labels (0 entailment) and -1 for unlabelled rows; a label that is not
    MNLI's names its line."""
    import json
    from types import SimpleNamespace

    from geosharp.errors import UsageError

    tsv = tmp_path / "a.tsv"
    tsv.write_text("premise\thypothesis\tlabel\nA b.\tC d.\tEntailment\nE f.\tG h.\t-\n")
    assert paper.read_mnli(tsv) == [("A b.", "C d.", "entailment")]
    jsonl = tmp_path / "a.jsonl"
    rows = [{"premise": "p", "hypothesis": "h", "label": lab} for lab in (0, 2, -1, 1)]
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    assert [r[2] for r in paper.read_mnli(jsonl)] == ["entailment", "contradiction", "neutral"]
    bad = tmp_path / "b.jsonl"
    bad.write_text(json.dumps({"premise": "p", "hypothesis": "h", "label": "maybe"}))
    with pytest.raises(UsageError, match="line 1: label 'maybe'"):
        paper.read_mnli(bad)
    generic = SimpleNamespace(num_labels=3, id2label={0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"})
    with pytest.raises(UsageError, match="--label-order"):
        paper.mnli_label_ids(generic)
    order = ["entailment", "neutral", "contradiction"]
    assert paper.mnli_label_ids(generic, order) == {
        "entailment": 0,
        "neutral": 1,
        "contradiction": 2,
    }
    named = SimpleNamespace(
        num_labels=3, id2label={0: "CONTRADICTION", 1: "entailment", 2: "Neutral"}
    )
    assert paper.mnli_label_ids(named)["contradiction"] == 0
    with pytest.raises(UsageError, match="disagrees"):
        paper.mnli_label_ids(named, order)


def test_imagenet_classes_are_matched_by_wnid(tmp_path, fake_imagenet):
    """A subset of the classes takes the head's indices from --classes (by wnid); without
    it only as many folders as classes are accepted; an empty root is an error."""
    from geosharp.errors import UsageError

    wnids = tmp_path / "LOC_synset_mapping.txt"
    wnids.write_text("n000 zero\nn001 one\nn002 two\nn003 three\nn004 four\n")
    ids = paper.imagenet_class_ids(fake_imagenet, 5, wnids)
    assert ids == {"n001": 1, "n002": 2, "n003": 3}
    (_, labels), *_ = paper.imagenet_batches(fake_imagenet, 6, size=32, class_ids=ids)
    assert sorted(set(labels.tolist())) == [1, 2, 3]
    with pytest.raises(UsageError, match="3 class folders and the head 5"):
        paper.imagenet_class_ids(fake_imagenet, 5)
    assert paper.imagenet_class_ids(fake_imagenet, 3) == {"n001": 0, "n002": 1, "n003": 2}
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no class folders"):
        paper.imagenet_class_ids(tmp_path / "empty", 3)


def test_clip_paper_driver_checks_every_fine_tune_before_measuring(tmp_path, capsys):
    """A fine-tune directory without its head was a FileNotFoundError traceback."""
    from geosharp.cli import main

    (tmp_path / "ft" / "finetune-0").mkdir(parents=True)
    (tmp_path / "ft" / "finetune-0" / "config.json").write_text("{}")
    argv = ["study", "paper", "clip", "--checkpoints", str(tmp_path / "ft"),
            "--data", str(tmp_path), "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "no classification_head.safetensors" in err[0], err
