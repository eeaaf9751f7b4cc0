"""What a user meets: no silent wrong results, one-line errors with exit status 2,
quiet parseable output, data in the formats people keep, reproducible runs."""

import copy
import json
import math
import os
import shutil
import stat

import numpy as np
import pytest
import torch

import geosharp
from geosharp.cli import main
from geosharp.errors import UsageError
from zoo import vit_case

SMALL = ["--n-points", "8", "--batch-size", "4", "--n-iters", "2", "--measures", "adaptive"]


def _one_line_error(capsys, code: int) -> str:
    captured = capsys.readouterr()
    assert code == 2, captured
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


# --------------------------------------------------------------------------- silent wrong results


@pytest.mark.parametrize("cond", [0, -3.0, 0.5, float("nan"), float("inf"), True, "10"])
def test_reparameterize_rejects_bad_cond_before_touching_weights(cond):
    case = vit_case(torch.float32)
    before = copy.deepcopy(case.model.state_dict())
    with pytest.raises((ValueError, TypeError), match="cond"):
        geosharp.reparameterize(case.model, cond=cond)
    after = case.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_reparameterize_accepts_numpy_cond():
    case = vit_case(torch.float64)
    geosharp.reparameterize(case.model, cond=np.float64(10.0))
    assert all(torch.isfinite(p).all() for p in case.model.parameters())


def test_checkpoint_without_tokenizer_is_refused(bert_dir, text_csv, tmp_path, capsys):
    bare = tmp_path / "weights-only"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(bert_dir / name, bare / name)
    line = _one_line_error(capsys, main(["measure", str(bare), "--data", str(text_csv), *SMALL]))
    assert "no tokenizer files" in line and "--tokenizer" in line
    args = ["measure", str(bare), "--data", str(text_csv), "--tokenizer", str(bert_dir), *SMALL]
    assert main(args) == 0


def _measure_json(tmp_path, name: str, *extra: str) -> dict:
    path = tmp_path / name
    args = ["measure", "minilm", "--data", "rotten-tomatoes", "--max-length", "12"]
    assert main([*args, *SMALL, "--n-points", "4", "--json", str(path), *extra]) == 0
    payload = json.loads(path.read_text())
    for row in payload["results"]:
        row.pop("seconds")
    return payload


def test_minilm_random_head_is_seeded_and_said(tmp_path, capsys):
    first = _measure_json(tmp_path, "a.json")
    err = capsys.readouterr().err
    assert sum("initialised at random" in line for line in err.splitlines()) == 1
    assert first == _measure_json(tmp_path, "b.json")
    other = _measure_json(tmp_path, "c.json", "--seed", "1")
    assert other["results"][0]["value"] != first["results"][0]["value"]
    assert first["new_parameters"] == ["classifier.bias", "classifier.weight"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_are_measured_in_float32(dtype):
    case = vit_case(torch.float32)
    half = case.model.to(dtype)
    widened = copy.deepcopy(half).float()  # the same weights, in float32
    batches = [(x.to(dtype), y) for x, y in case.batches]
    kwargs = dict(measure="adaptive", rho=0.05, estimator=geosharp.WorstCase(3), seed=0)
    low = geosharp.sharpness(half, batches, case.loss_fn, **kwargs)
    ref = geosharp.sharpness(widened, [(x.float(), y) for x, y in batches], case.loss_fn, **kwargs)
    assert low.value > 0 and low.settings["dtype"] == "float32"
    assert low.value == pytest.approx(ref.value, rel=1e-5)
    assert all(p.dtype == dtype for p in half.parameters())  # the model is untouched


def test_negative_n_points_is_an_error(bert_dir, text_csv, capsys):
    code = main(["measure", str(bert_dir), "--data", str(text_csv), "--n-points", "-5"])
    assert "--n-points" in _one_line_error(capsys, code)


# --------------------------------------------------------------------------- one-line errors


def _bad_inputs(bert, vit, csv, tmp):
    (tmp / "bare.pt").write_bytes(b"")
    torch.save(torch.zeros(3), tmp / "tensor.pt")
    (tmp / "labels.csv").write_text("text,label\ngood film,0\nbad film,7\n")
    (tmp / "data.xyz").write_text("x")
    (tmp / "named.csv").write_text("text,label\ngood film,positive\n")
    (tmp / "empty_text.csv").write_text("text,label\ngood film,0\n  ,1\n")
    (tmp / "short_row.csv").write_text("text,label\ngood film,0\nbad film\n")
    (tmp / "null.jsonl").write_text('{"text": "good", "label": 0}\n{"text": null, "label": 1}\n')
    (tmp / "latin1.csv").write_bytes("text,label\ncaf\xe9 film,0\n".encode("latin-1"))
    pixels = torch.zeros(4, 1, 8, 8)
    torch.save({"pixel_values": pixels, "labels": torch.zeros(3, dtype=torch.long)}, tmp / "n.pt")
    torch.save({"pixel_values": pixels, "labels": torch.zeros(4)}, tmp / "float.pt")
    torch.save({"pixel_values": pixels, "labels": [0, 1, 2, 3]}, tmp / "list.pt")
    m = ["measure", str(bert), "--data", str(csv)]
    small_vocab = _bert(tmp / "small_vocab", vocab_size=8)
    regression = _bert(tmp / "regression", num_labels=1)
    multi = _bert(tmp / "multi", num_labels=2, problem_type="multi_label_classification")
    no_pad = _gpt2(tmp / "gpt2")
    torch.save({"pixels": pixels, "labels": torch.zeros(4, dtype=torch.long)}, tmp / "key.pt")
    ids = {"input_ids": torch.zeros(4, 5), "labels": torch.zeros(4, dtype=torch.long)}
    torch.save(ids, tmp / "float_ids.pt")
    broken = {}
    for name in ("bad_config", "no_weights", "cut_weights"):
        broken[name] = tmp / name
        shutil.copytree(bert, broken[name])
    (broken["bad_config"] / "config.json").write_text('{"model_type": "bert", ')
    (broken["no_weights"] / "model.safetensors").unlink()
    weights = broken["cut_weights"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    (tmp / "imgs" / "0").mkdir(parents=True)
    (tmp / "imgs" / "0" / "a.png").write_bytes(b"not a png")
    two = {"input_ids": torch.full((2, 4), 5), "labels": torch.tensor([[0.0, 1.0], [2.0, 0.0]])}
    torch.save(two, tmp / "multi_two.pt")
    nan_target = {"input_ids": torch.full((2, 4), 5), "labels": torch.tensor([0.5, float("nan")])}
    torch.save(nan_target, tmp / "regression_nan.pt")
    (tmp / "list.jsonl").write_text('{"text": ["good", "film"], "label": 0}\n')
    (tmp / "superscript.csv").write_text("text,label\ngood film,\u00b2\n", encoding="utf-8")
    (tmp / "nan.csv").write_text("text,label\ngood film,0.5\nbad film,nan\n")
    return {
        "symmetries corrupt config.json": (
            ["symmetries", str(broken["bad_config"])],
            "config.json: cannot be read",
        ),
        "symmetries without weights": (["symmetries", str(broken["no_weights"])], "no weights"),
        "symmetries truncated weights": (["symmetries", str(broken["cut_weights"])], "truncated"),
        "plot without an extension": (
            [*m, "--per", "layer", "--plot", str(tmp / "layers")],
            "--plot " + str(tmp / "layers") + ": no file extension",
        ),
        "causal-lm task on a classifier": (
            [*m, "--task", "causal-lm"],
            "--task causal-lm: the checkpoint is a BertForSequenceClassification",
        ),
        "multi-label target 2": (
            ["measure", str(multi), "--data", str(tmp / "multi_two.pt")],
            "row 1 holds 2 for label 0",
        ),
        "jsonl text a list": (
            ["measure", str(bert), "--data", str(tmp / "list.jsonl")],
            "'text' is a JSON list, not a string",
        ),
        "label a superscript digit": (
            ["measure", str(bert), "--data", str(tmp / "superscript.csv")],
            "neither a class index nor",
        ),
        "regression target nan in a .pt": (
            ["measure", str(regression), "--data", str(tmp / "regression_nan.pt")],
            "'labels' row 1 holds nan",
        ),
        "regression label nan": (
            ["measure", str(regression), "--data", str(tmp / "nan.csv")],
            "data row 2: label 'nan' is not a finite number",
        ),
        "corrupt config.json": (
            ["measure", str(broken["bad_config"]), "--data", str(csv)],
            "config.json: cannot be read",
        ),
        "no weights": (
            ["measure", str(broken["no_weights"]), "--data", str(csv)],
            "has no weights",
        ),
        "truncated weights": (
            ["measure", str(broken["cut_weights"]), "--data", str(csv)],
            "truncated",
        ),
        "corrupt image": (
            ["measure", str(vit), "--data", str(tmp / "imgs")],
            "a.png: not a readable image",
        ),
        "seed 2**70": ([*m, "--seed", str(2**70)], "--seed"),
        "rho half a pair": ([*m, "--rho", "adaptive=0.05,geodesic-mix"], "could not read --rho"),
        "max-length 1": ([*m, "--max-length", "1"], "leaves no room"),
        "tokenizer larger than the vocabulary": (
            ["measure", str(small_vocab), "--data", str(csv)],
            "the model's vocabulary has 8",
        ),
        "gpt-2 without pad_token_id": (
            ["measure", str(no_pad), "--data", str(csv)],
            "pad_token_id",
        ),
        "regression head on class names": (
            ["measure", str(regression), "--data", str(tmp / "named.csv")],
            "not a number",
        ),
        "regression head on built-in classes": (
            ["measure", str(regression), "--data", "rotten-tomatoes"],
            "regression head",
        ),
        "multi-label head on a csv": (["measure", str(multi), "--data", str(csv)], "multi-label"),
        "pt key the model does not take": (
            ["measure", str(vit), "--data", str(tmp / "key.pt")],
            "takes no input 'pixels'",
        ),
        "pt inputs of the wrong dtype": (
            ["measure", str(bert), "--data", str(tmp / "float_ids.pt")],
            "cannot run on it",
        ),
        "missing checkpoint": (["measure", str(tmp / "nope"), "--data", str(csv)], "not found"),
        "missing csv": (["measure", str(bert), "--data", str(tmp / "nope.csv")], "no such"),
        "rho 0": ([*m, "--rho", "0"], "--rho"),
        "rho -1": ([*m, "--rho=-1"], "--rho"),
        "rho nan": ([*m, "--rho", "nan"], "--rho"),
        "rho inf": ([*m, "--rho", "inf"], "--rho"),
        "rho text": ([*m, "--rho", "big"], "--rho"),
        "rho unknown measure": ([*m, "--rho", "euclidean=0.1"], "not in --measures"),
        "measures bogus": ([*m, "--measures", "bogus"], "unknown measure"),
        "measures empty": ([*m, "--measures", ""], "empty"),
        "n-points 0": ([*m, "--n-points", "0"], "--n-points"),
        "batch-size 0": ([*m, "--batch-size", "0"], "--batch-size"),
        "n-iters 0": ([*m, "--n-iters", "0"], "--n-iters"),
        "labels outside classes": (
            ["measure", str(bert), "--data", str(tmp / "labels.csv")],
            "outside the model's 2 classes",
        ),
        "device cuda": ([*m, "--device", "cuda:7"], "--device"),
        "device foo": ([*m, "--device", "foo"], "--device"),
        "pt bare tensor": (
            ["measure", str(vit), "--data", str(tmp / "tensor.pt")],
            "dict of input tensors",
        ),
        "pt unreadable": (["measure", str(vit), "--data", str(tmp / "bare.pt")], "torch.load"),
        "pt lengths differ": (
            ["measure", str(vit), "--data", str(tmp / "n.pt")],
            "pixel_values 4, labels 3",
        ),
        "pt float labels": (["measure", str(vit), "--data", str(tmp / "float.pt")], "integers"),
        "pt labels not a tensor": (
            ["measure", str(vit), "--data", str(tmp / "list.pt")],
            "dict of input tensors",
        ),
        "empty text": ([*m[:3], str(tmp / "empty_text.csv")], "data row 2: 'text' is empty"),
        "short csv row": ([*m[:3], str(tmp / "short_row.csv")], "'label' is missing"),
        "null text": ([*m[:3], str(tmp / "null.jsonl")], "data row 2: 'text' is missing"),
        "csv not utf-8": ([*m[:3], str(tmp / "latin1.csv")], "not UTF-8"),
        "unknown data format": ([*m[:3], str(tmp / "data.xyz")], "unknown format"),
        "text data for a vision model": (["measure", str(vit), "--data", str(csv)], "text data"),
        "symmetries missing path": (["symmetries", str(tmp / "nope")], "not found"),
        "json into a missing dir": ([*m, "--json", str(tmp / "no" / "x.json")], "does not exist"),
        "json is a directory": ([*m, "--json", str(tmp)], "directory"),
        "json is the data file": ([*m, "--json", str(csv)], "is --data"),
        "json inside the checkpoint": (
            [*m, "--json", str(bert / "config.json")],
            "is inside the checkpoint",
        ),
        "json over the tokenizer": (
            [*m, "--tokenizer", str(bert), "--json", str(bert / "new.json")],
            "inside the checkpoint",
        ),
        "tokenizer missing": ([*m, "--tokenizer", str(tmp / "nope")], "--tokenizer"),
        "unknown column": ([*m, "--text-column", "review"], "no column 'review'"),
        "demo cond": (["demo", "--cond", "0.5"], "--cond"),
        "unknown command": (["sharpen"], "invalid choice"),
    }


def test_every_bad_input_is_one_line_and_exit_2(bert_dir, vit_dir, text_csv, tmp_path, capsys):
    cases = _bad_inputs(bert_dir, vit_dir, text_csv, tmp_path)
    capsys.readouterr()  # what building the checkpoints printed
    for name, (argv, expected) in cases.items():
        line = _one_line_error(capsys, main(argv))
        assert expected in line, (name, line)


def test_debug_shows_the_traceback(bert_dir, text_csv):
    with pytest.raises(UsageError, match="--rho"):
        main(["--debug", "measure", str(bert_dir), "--data", str(text_csv), "--rho", "0"])


@pytest.mark.parametrize(
    "bad",
    [
        ["--rho", "-1"],
        ["--json", "/no/such/dir/x.json"],
        ["--device", "foo"],
        ["--json", "CHECKPOINT/config.json"],
    ],
)
def test_arguments_are_checked_before_the_model_loads(bert_dir, text_csv, monkeypatch, capsys, bad):
    import geosharp.loading.hf

    def forbidden(*args, **kwargs):
        raise AssertionError("the model must not be loaded before the arguments are checked")

    monkeypatch.setattr(geosharp.loading.hf, "load_classifier", forbidden)
    monkeypatch.setattr(geosharp.loading.hf, "load_config", forbidden)
    bad = [a.replace("CHECKPOINT", str(bert_dir)) for a in bad]
    _one_line_error(capsys, main(["measure", str(bert_dir), "--data", str(text_csv), *bad]))


def test_nonfinite_value_is_inf_with_its_reason_and_json_stays_strict(
    bert_dir, text_csv, tmp_path, capsys
):
    """--nonfinite inf: the value is inf (null in JSON, which other readers accept),
    never 0 ("flat"), and the row and a note say where; --force writes where an input
    lives (here a copy of the data file)."""
    data = tmp_path / "data.csv"
    data.write_bytes(text_csv.read_bytes())
    args = ["measure", str(bert_dir), "--data", str(data), "--measures", "adaptive",
            "--rho", "1e38", "--n-iters", "2", "--n-points", "8", "--nonfinite", "inf",
            "--json", str(data), "--force"]  # fmt: skip
    assert main(args[:-5]) == 2  # by default an error, after the info line
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "Auto-PGD step 1: loss nan" in error and "--nonfinite inf" in error
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "note: adaptive is inf" in captured.err and "inf" in captured.out
    text = data.read_text()
    assert "NaN" not in text and "Infinity" not in text
    row = json.loads(text)["results"][0]
    assert row["value"] is None and row["per_batch"] == [None]
    assert "Auto-PGD step" in row["nonfinite"][0]


# --------------------------------------------------------------------------- API checks


def test_rho_accepts_numpy_and_torch_scalars_and_rejects_booleans():
    case = vit_case(torch.float64)
    kwargs = dict(measure="adaptive", estimator=geosharp.WorstCase(2), seed=0)
    ref = geosharp.sharpness(case.model, case.batches, case.loss_fn, rho=0.05, **kwargs).value
    for rho in (np.float64(0.05), torch.tensor(0.05, dtype=torch.float64)):
        value = geosharp.sharpness(case.model, case.batches, case.loss_fn, rho=rho, **kwargs)
        assert value.value == ref and isinstance(value.rho, float)
    for bad in (True, np.bool_(True), "0.05", torch.ones(2), float("nan"), 0):
        with pytest.raises((TypeError, ValueError), match="rho"):
            geosharp.sharpness(case.model, case.batches, case.loss_fn, rho=bad, **kwargs)


def test_default_rho_is_the_measure_table_s():
    from geosharp.measures import DEFAULT_RHO

    case = vit_case(torch.float64)
    for geometry, metric, name in [
        ("geodesic", "mix", "geodesic-mix"),
        ("geodesic", "inv", "geodesic-inv"),
        ("adaptive", "inv", "adaptive"),
    ]:
        result = geosharp.sharpness(
            case.model,
            case.batches,
            case.loss_fn,
            geosharp.Geometry.named(geometry, metric=metric),
            estimator=geosharp.WorstCase(n_iters=1),
        )
        assert result.rho == DEFAULT_RHO[name]


def test_empty_parameter_list_and_loss_without_grad_are_explained():
    case = vit_case(torch.float64)
    with pytest.raises(ValueError, match=r"parameters=\[\] names no parameter"):
        geosharp.sharpness(case.model, case.batches, case.loss_fn, parameters=[])

    def detached(model, batch):
        with torch.no_grad():
            return case.loss_fn(model, batch)

    with pytest.raises(ValueError, match="does not require grad"):
        geosharp.sharpness(
            case.model, case.batches, detached, estimator=geosharp.WorstCase(n_iters=2)
        )


# --------------------------------------------------------------------------- quiet output


def test_no_load_reports_bars_or_ansi_codes(tmp_path, capsys):
    _measure_json(tmp_path, "quiet.json")
    captured = capsys.readouterr()
    text = captured.out + captured.err
    for noise in ("LOAD REPORT", "Loading weights", "\x1b", "\r", "MISSING"):
        assert noise not in text, noise


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_otherwise():
    import io

    from geosharp.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty, log = Terminal(), io.StringIO()
    ticks = iter(float(t) for t in range(0, 400, 20))
    list(Progress(range(10), desc="x", stream=tty))
    list(Progress(range(10), desc="x", unit="batch", stream=log, clock=lambda: next(ticks)))
    assert "\r" in tty.getvalue()  # a tqdm bar
    lines = log.getvalue().splitlines()
    assert lines and all(line.startswith("x: ") and "/10 batch" in line for line in lines)
    assert "\x1b" not in log.getvalue() and "\r" not in log.getvalue()


def test_results_files_are_readable_by_others(tmp_path):
    from geosharp.io import write_json_atomic, write_text_atomic

    old = os.umask(0o022)
    try:
        write_json_atomic(tmp_path / "a.json", {"x": np.float32(1.5)})
        write_text_atomic(tmp_path / "b.md", "text")
    finally:
        os.umask(old)
    for name in ("a.json", "b.md"):
        mode = stat.S_IMODE((tmp_path / name).stat().st_mode)
        assert mode == 0o644, oct(mode)
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 1.5}


# --------------------------------------------------------------------------- data formats


def _measure_value(capsys, argv) -> float:
    assert main([*argv, *SMALL, "--json", "-"]) == 0
    return json.loads(capsys.readouterr().out)["results"][0]["value"]


def test_text_data_formats_agree(bert_dir, text_csv, tmp_path, capsys):
    import csv as csvlib

    with text_csv.open() as f:
        rows = list(csvlib.DictReader(f))
    names = {"0": "negative", "1": "positive"}
    with (tmp_path / "d.jsonl").open("w") as f:  # other column names, label names
        for r in rows:
            f.write(json.dumps({"review": r["text"], "sentiment": names[r["label"]]}) + "\n")
    (tmp_path / "d.tsv").write_text(
        "sentence\ty\n" + "".join(f"{r['text']}\t{r['label']}\n" for r in rows)
    )
    import datasets

    table = datasets.Dataset.from_dict(
        {"text": [r["text"] for r in rows], "label": [int(r["label"]) for r in rows]}
    )
    datasets.DatasetDict(train=table).save_to_disk(str(tmp_path / "hf"))

    (tmp_path / "excel.csv").write_bytes(b"\xef\xbb\xbf" + text_csv.read_bytes())  # a BOM

    base = ["measure", str(bert_dir), "--data"]
    reference = _measure_value(capsys, [*base, str(text_csv)])
    assert _measure_value(capsys, [*base, str(tmp_path / "excel.csv")]) == reference
    jsonl = [*base, str(tmp_path / "d.jsonl"), "--text-column", "review"]
    tsv = [*base, str(tmp_path / "d.tsv"), "--text-column", "sentence", "--label-column", "y"]
    assert _measure_value(capsys, [*jsonl, "--label-column", "sentiment"]) == reference
    assert _measure_value(capsys, tsv) == reference
    assert _measure_value(capsys, [*base, str(tmp_path / "hf")]) == reference
    line = _one_line_error(capsys, main([*base, str(tmp_path / "hf"), "--split", "test"]))
    assert "--split" in line


@pytest.fixture(scope="module")
def trained_vit(tmp_path_factory):
    """A tiny ViT trained on an image folder as its owner made it: classes numbered by
    its own label2id (not the folders' sorted order), pixels through its own image
    processor (8x8, mean 0.3, std 0.2). Returns the checkpoint, the folder and the
    training loss."""
    from PIL import Image
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    root = tmp_path_factory.mktemp("trained_vit")
    names = ["zebra", "apple", "mango"]  # ids 0, 1, 2; sorted order would be 1, 2, 0
    gen = np.random.default_rng(0)
    images, labels = [], []
    for label, name in enumerate(names):
        (root / "imgs" / name).mkdir(parents=True)
        for i in range(8):
            x = gen.random((12, 12)) * 60
            x[[slice(0, 6), slice(6, 12), slice(3, 9)][label]] += 180  # a band per class
            image = Image.fromarray(x.astype(np.uint8))
            image.save(root / "imgs" / name / f"{i}.png")
            images.append(image)
            labels.append(label)
    processor = ViTImageProcessor(size={"height": 8, "width": 8}, image_mean=[0.3], image_std=[0.2])
    config = ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=16,
                       num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                       id2label=dict(enumerate(names)),
                       label2id={n: i for i, n in enumerate(names)})  # fmt: skip
    torch.manual_seed(0)
    model = ViTForImageClassification(config)
    x = processor(images=images, return_tensors="pt")["pixel_values"]
    y = torch.tensor(labels)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(pixel_values=x).logits, y).backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        loss = float(torch.nn.functional.cross_entropy(model(pixel_values=x).logits, y))
    model.save_pretrained(root / "ckpt")
    processor.save_pretrained(root / "ckpt")
    return root / "ckpt", root / "imgs", loss


def test_image_folder_is_measured_as_the_model_was_trained(trained_vit, tmp_path, capsys):
    """Labels through label2id, pixels through the checkpoint's image processor: the
    unperturbed loss is the training loss (within 1%; sorted folders or (x - 0.5) / 0.5
    give another problem's loss); folders that are not label names are an error."""
    import shutil

    ckpt, imgs, train_loss = trained_vit
    assert train_loss < 0.05
    argv = ["measure", str(ckpt), "--data", str(imgs), "--n-points", "24", "--batch-size", "12",
            "--n-iters", "2", "--measures", "geodesic-inv", "--json", "-"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    payload = json.loads(captured.out)
    assert payload["fit"]["loss"] == pytest.approx(train_loss, rel=0.01)
    assert payload["fit"]["accuracy"] == 1.0
    assert payload["results"][0]["loss"] == pytest.approx(train_loss, rel=0.01)
    assert "apple=1, mango=2, zebra=0" in captured.err and "ViTImageProcessor" in captured.err
    shutil.copytree(imgs, tmp_path / "imgs")
    (tmp_path / "imgs" / "zebra").rename(tmp_path / "imgs" / "horse")
    argv[3] = str(tmp_path / "imgs")
    line = _one_line_error(capsys, main(argv))
    assert "['horse']" in line and "'zebra'" in line


def test_image_folder_without_processor_or_names(vit_dir, tmp_path, capsys):
    """A checkpoint without label names takes folders named by index, or as many folders
    as classes in sorted order, and says so; without preprocessor_config.json the ViT
    default scaling is used and said."""
    from PIL import Image

    gen = np.random.default_rng(0)
    for c in range(3):
        (tmp_path / "imgs" / str(c)).mkdir(parents=True)
        for i in range(3):
            pixels = (gen.random((12, 12)) * 255).astype(np.uint8)
            Image.fromarray(pixels).save(tmp_path / "imgs" / str(c) / f"{i}.png")
    value = _measure_value(capsys, ["measure", str(vit_dir), "--data", str(tmp_path / "imgs")])
    assert math.isfinite(value) and value > 0
    (tmp_path / "imgs" / "2").rename(tmp_path / "imgs" / "cat")
    line = _one_line_error(
        capsys, main(["measure", str(vit_dir), "--data", str(tmp_path / "imgs"), *SMALL])
    )
    assert "3 class folders for a model of 10 unnamed classes" in line


def _bert(path, tokenizer_words=None, **overrides):
    """A tiny BERT classifier saved to ``path`` with a word-level tokenizer."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    from conftest import WORDS

    path.mkdir(parents=True, exist_ok=True)
    words = tokenizer_words or WORDS
    (path / "vocab.txt").write_text(
        "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])
    )
    config = dict(vocab_size=len(WORDS) + 5, hidden_size=16, num_hidden_layers=1,
                  num_attention_heads=2, intermediate_size=32,
                  max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig(**{**config, **overrides})).save_pretrained(path)
    BertTokenizerFast(vocab=str(path / "vocab.txt")).save_pretrained(path)
    return path


def _gpt2(path, **overrides):
    """A tiny GPT-2 classifier with a byte-level tokenizer that has no pad token."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2TokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    config = GPT2Config(vocab_size=len(vocab), n_embd=16, n_layer=1, n_head=2, n_positions=64,
                        num_labels=2, bos_token_id=256, eos_token_id=256,
                        **overrides)  # fmt: skip
    torch.manual_seed(0)
    GPT2ForSequenceClassification(config).save_pretrained(path)
    GPT2TokenizerFast(vocab=vocab, merges=[]).save_pretrained(path)
    return path


def _causal_lm(path, kind="gpt2"):
    """A tiny causal LM (GPT-2, or LLaMA with grouped-query attention and rotary
    embeddings) with a byte-level tokenizer that has no pad token."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        GPT2TokenizerFast,
        LlamaConfig,
        LlamaForCausalLM,
    )

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(vocab_size=len(vocab), n_embd=16, n_layer=1, n_head=2,
                            n_positions=64, bos_token_id=256, eos_token_id=256)  # fmt: skip
        model = GPT2LMHeadModel(config)
    elif kind == "llama":
        config = LlamaConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64, bos_token_id=256, eos_token_id=256,
                             pad_token_id=None)  # fmt: skip
        model = LlamaForCausalLM(config)
    else:  # DeepSeek-V3 in bfloat16: its router stays float32 where transformers loads it
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        config = DeepseekV3Config(
            vocab_size=len(vocab), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, intermediate_size=32, moe_intermediate_size=8,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=4, max_position_embeddings=64, n_group=2,
            topk_group=1, bos_token_id=256, eos_token_id=256, pad_token_id=None,
        )  # fmt: skip
        model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer = GPT2TokenizerFast(vocab=vocab, merges=[])
    tokenizer.eos_token = "<|endoftext|>"
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_causal_lm_from_the_command_line(kind, tmp_path, capsys):
    """A causal LM on a text file: the next-token loss with padding masked (what
    transformers computes with labels -100 on padding), its symmetries found and used,
    attention-only measurement; data that are not texts are refused."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = _causal_lm(tmp_path / kind, kind)
    texts = ["the film was good", "a dull plot", "fun", "the actor was superb and the plot was fun"]
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n\n")
    argv = ["measure", str(ckpt), "--data", str(tmp_path / "texts.txt"), "--n-iters", "2",
            "--measures", "adaptive,geodesic-inv,geodesic-inv-attn", "--json", "-"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    payload = json.loads(captured.out)
    assert "next-token loss" in captured.err and "padding with the end-of-text" in captured.err
    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    with torch.no_grad():
        reference = float(model(**enc, labels=labels).loss)
    assert payload["fit"]["loss"] == pytest.approx(reference, rel=1e-5)
    assert payload["fit"]["target_tokens"] == int(enc["attention_mask"][:, 1:].sum())
    rows = {r["measure"]: r for r in payload["results"]}
    assert rows["adaptive"]["loss"] == pytest.approx(reference, rel=1e-5)
    assert payload["symmetries"]["pairs"] > 0 and payload["symmetries"]["ignored"] == []
    assert all(r["value"] > 0 for r in rows.values())
    torch.save({"input_ids": enc["input_ids"]}, tmp_path / "ids.pt")
    capsys.readouterr()  # what loading the reference printed
    line = _one_line_error(capsys, main([*argv[:3], str(tmp_path / "ids.pt")]))
    assert "causal LM: give --data as texts" in line
    line = _one_line_error(capsys, main([*argv, "--max-length", "1"]))
    assert "no next token" in line


ONLY_PROCESS_0_READS = """
import os, sys
import transformers
from geosharp.cli import main
rank = int(os.environ.get("RANK", "0"))
if rank or os.environ.get("UNREADABLE"):  # the others must not read; process 0 may fail
    def refuse(*args, **kwargs):
        if rank:
            raise AssertionError(f"process {rank} read the checkpoint")
        raise OSError("unreadable here")
    transformers.PreTrainedModel.from_pretrained = classmethod(refuse)
sys.exit(main(sys.argv[1:]))
"""


def test_a_causal_lm_sharded_with_fsdp_from_the_command_line(tmp_path, capsys):
    """``torchrun ... geosharp measure --fsdp``: a GPT-2 (fused query/key/value, its
    head tied to the embedding) in float32 and a LLaMA (grouped-query attention, rotary)
    in bfloat16 with activation checkpointing, sharded over 2 processes, get the values
    of one process, the weights read by process 0 only (the others would raise); a
    checkpoint process 0 cannot read is one line on every process; without torchrun
    --fsdp is a one-line error."""
    from launch import launch, run_python

    (tmp_path / "texts.txt").write_text("the film was good\na dull plot\nfun\nthe plot\n")
    (tmp_path / "only0.py").write_text(ONLY_PROCESS_0_READS)
    for kind, dtype, more in (
        ("gpt2", "float32", []),
        ("llama", "bfloat16", ["--gradient-checkpointing"]),
    ):
        base = ["measure", str(_causal_lm(tmp_path / kind, kind)), "--data",
                str(tmp_path / "texts.txt"), "--n-iters", "2", "--batch-size", "2",
                "--measures", "adaptive,geodesic-inv", "--json", "-", "--quiet"]  # fmt: skip
        capsys.readouterr()  # what saving the checkpoint printed
        assert main([*base, "--dtype", dtype]) == 0
        one = json.loads(capsys.readouterr().out)
        sharded = json.loads(
            run_python([str(tmp_path / "only0.py"), *base, "--dtype", dtype, "--fsdp", *more], 2)
        )
        found, alone = sharded["symmetries"], one["symmetries"]
        assert found.keys() == alone.keys() and found["verified"].keys() == alone["verified"].keys()
        assert all(found[k] == alone[k] for k in found if k != "verified")  # not round-off
        said = "weights: read by process 0 on the CPU; each process receives its shards"
        assert said in sharded["loading"]
        for a, b in zip(one["results"], sharded["results"], strict=True):
            assert b["settings"]["sharded"] == 2, dtype
            assert b["settings"]["precision"] == a["settings"]["precision"], dtype
            assert b["settings"]["checkpointing"] is bool(more), dtype
            assert b["per_batch"] == pytest.approx(a["per_batch"], rel=1e-4), dtype
    assert "bfloat16 elsewhere" in b["settings"]["precision"]
    # process 0 cannot read the weights: every process says so and leaves at once (the
    # others would wait for it in a collective)
    proc = launch([str(tmp_path / "only0.py"), *base, "--fsdp"], 2, timeout=120,
                  env={"UNREADABLE": "1"}, torchrun=True)  # fmt: skip
    said = [x for x in proc.stderr.splitlines() if x.startswith("geosharp: error:")]
    assert proc.returncode != 0 and said, proc.stderr[-3000:]  # torchrun may end one first
    assert all("the weights cannot be loaded (unreadable here)" in x for x in said), said
    assert "process 0 failed" not in proc.stderr and "Traceback" not in "".join(
        x for x in proc.stderr.splitlines() if x.startswith("[rank")
    )
    line = _one_line_error(capsys, main([*base[:-1], "--fsdp"]))
    assert "--fsdp shards the model over torchrun's processes" in line


def test_the_sharded_loads_skeleton_takes_process_0s_dtypes_and_ties():
    """``--fsdp``'s model on the meta device: each tensor in the dtype process 0 loaded
    it in, a tied head still the embedding's object; names other than process 0's are a
    one-line error."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from geosharp.loading.job import _on_meta

    config = GPT2Config(vocab_size=20, n_embd=8, n_layer=1, n_head=2, n_positions=16)
    with torch.device("meta"):
        reference = GPT2LMHeadModel(config)
    tensors = (*reference.named_parameters(), *reference.named_buffers())
    dtypes = {n: torch.bfloat16 if t.is_floating_point() else t.dtype for n, t in tensors}
    dtypes["transformer.ln_f.weight"] = torch.float32  # kept in float32, as some models do
    model = _on_meta(GPT2LMHeadModel, config, dtypes)
    assert model.lm_head.weight is model.transformer.wte.weight
    got = {n: t.dtype for n, t in (*model.named_parameters(), *model.named_buffers())}
    assert got == dtypes
    with pytest.raises(UsageError, match="other parameters than the checkpoint loaded"):
        _on_meta(GPT2LMHeadModel, config, {**dtypes, "extra.weight": torch.float32})


def test_weights_dtype_and_checkpointing_options(tmp_path, capsys, monkeypatch):
    """``--dtype auto`` takes the checkpoint's dtype (float32 where config.json names
    none, said); ``--gradient-checkpointing`` keeps the values, and a class without it
    is a one-line error before the weights load."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from geosharp.loading.job import weights_dtype

    assert weights_dtype("float32", LlamaConfig()) == (torch.float32, None)
    dtype, said = weights_dtype("auto", LlamaConfig(dtype="bfloat16"))
    assert dtype == torch.bfloat16 and "the checkpoint's dtype" in said
    dtype, said = weights_dtype("auto", LlamaConfig())
    assert dtype == torch.float32 and "names no dtype" in said
    dtype, said = weights_dtype("float32", LlamaConfig(dtype="bfloat16"))
    assert dtype == torch.float32 and "the checkpoint holds bfloat16: --dtype auto" in said
    ckpt = _causal_lm(tmp_path / "llama", "llama")
    (tmp_path / "texts.txt").write_text("the film was good\na dull plot\n")
    base = ["measure", str(ckpt), "--data", str(tmp_path / "texts.txt"), "--n-iters", "2",
            "--measures", "adaptive", "--json", "-", "--quiet"]  # fmt: skip
    capsys.readouterr()
    rows = []
    for more in ([], ["--gradient-checkpointing"]):
        assert main([*base, *more]) == 0
        rows.append(json.loads(capsys.readouterr().out))
    plain, kept = (r["results"][0] for r in rows)
    assert kept["settings"]["checkpointing"] and not plain["settings"]["checkpointing"]
    assert kept["per_batch"] == pytest.approx(plain["per_batch"], rel=1e-6)
    assert any("activation checkpointing: on" in x for x in rows[1]["loading"])
    monkeypatch.setattr(LlamaForCausalLM, "supports_gradient_checkpointing", False)
    line = _one_line_error(capsys, main([*base, "--gradient-checkpointing"]))
    assert "does not support activation checkpointing" in line


def test_text_limits_and_pad_token(text_csv, tmp_path, capsys):
    """--max-length is capped at the model's positions, with the number of texts cut;
    a GPT-2 whose config has pad_token_id pads with it (without one: an error, in the
    bad-input table)."""
    long = tmp_path / "long.csv"
    long.write_text(
        "text,label\n" + "".join(f"{'the film was good ' * (i + 1)},{i % 2}\n" for i in range(6))
    )
    short = _bert(tmp_path / "short", max_position_embeddings=10)
    assert main(["measure", str(short), "--data", str(long), *SMALL]) == 0
    err = capsys.readouterr().err
    assert "above the model's positions (10): texts cut at 10" in err
    assert "4 of 6 texts are longer than 10 tokens" in err
    gpt2 = _gpt2(tmp_path / "gpt2", pad_token_id=256)
    assert main(["measure", str(gpt2), "--data", str(text_csv), *SMALL]) == 0


def test_regression_and_multi_label_heads_get_their_own_loss(tmp_path, capsys):
    """num_labels=1: mean squared error on number targets (not a cross-entropy of 0);
    problem_type multi-label: binary cross-entropy on 0/1 rows of a .pt file."""
    from transformers import AutoModelForSequenceClassification

    data = tmp_path / "scores.csv"
    data.write_text("text,score\n" + "".join(f"the film was good,{i / 4}\n" for i in range(8)))
    reg = _bert(tmp_path / "reg", num_labels=1)
    argv = ["measure", str(reg), "--data", str(data), "--label-column", "score", *SMALL]
    assert main([*argv, "--json", "-"]) == 0
    payload = json.loads(capsys.readouterr().out)
    model = AutoModelForSequenceClassification.from_pretrained(reg).eval()
    enc = {k: v[:1] for k, v in payload_inputs(reg, ["the film was good"]).items()}
    with torch.no_grad():
        out = float(model(**enc).logits)
    targets = torch.arange(8) / 4
    assert payload["fit"]["loss"] == pytest.approx(float(((out - targets) ** 2).mean()), rel=1e-5)
    assert payload["fit"]["accuracy"] is None and payload["results"][0]["value"] > 0

    multi = _bert(tmp_path / "multi", num_labels=3, problem_type="multi_label_classification")
    enc = payload_inputs(multi, ["the film was good", "bad plot", "fun", "dull actor"])
    targets = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.float32)
    torch.save({**enc, "labels": targets}, tmp_path / "multi.pt")
    assert (
        main(["measure", str(multi), "--data", str(tmp_path / "multi.pt"), *SMALL, "--json", "-"])
        == 0
    )
    payload = json.loads(capsys.readouterr().out)
    model = AutoModelForSequenceClassification.from_pretrained(multi).eval()
    with torch.no_grad():
        logits = model(**enc).logits
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets)
    assert payload["fit"]["loss"] == pytest.approx(float(bce), rel=1e-5)


def payload_inputs(checkpoint, texts):
    from transformers import AutoTokenizer

    return dict(AutoTokenizer.from_pretrained(checkpoint)(texts, padding=True, return_tensors="pt"))


def test_killed_run_resumes_without_measuring_again(bert_dir, text_csv, tmp_path, capsys):
    """Each measure is written when it is done: a run killed (SIGKILL) during its second
    measure leaves a valid file with the first; --resume keeps that one as it is and
    measures the rest; other settings are refused before the model loads."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out.json"
    argv = ["measure", str(bert_dir), "--data", str(text_csv), "--measures",
            "adaptive,geodesic-inv", "--n-iters", "100", "--quiet", "--json", str(out)]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "geosharp.cli", *argv],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and len(json.loads(out.read_text())["results"]) == 1:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.02)
        proc.wait(30)
    finally:
        proc.kill()
    killed = json.loads(out.read_text())
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert killed["complete"] is False and [r["measure"] for r in killed["results"]] == ["adaptive"]

    line = _one_line_error(capsys, main([*argv, "--resume", "--n-iters", "5"]))
    assert "other settings: n_iters (100 there, 5 now)" in line
    older = tmp_path / "older.json"  # a file of the versions that kept the best gradient
    settings = {k: v for k, v in killed["settings"].items() if k != "restart"}
    older.write_text(json.dumps(killed | {"settings": settings}))
    line = _one_line_error(capsys, main([*argv[:-1], str(older), "--resume"]))
    assert "other settings: restart (None there, 'revisit' now)" in line
    assert main([*argv, "--resume"]) == 0
    assert "already measured" in capsys.readouterr().err
    resumed = json.loads(out.read_text())
    assert resumed["complete"] is True and resumed["results"][0] == killed["results"][0]
    assert resumed["results"][1]["measure"] == "geodesic-inv"


# --------------------------------------------------------------------------- one command tree


@pytest.mark.parametrize(
    "argv, option",
    [
        (["measure"], "--text-column"),
        (["symmetries"], "--no-check"),
        (["demo"], "--cond"),
    ],
)
def test_every_command_shows_its_options(argv, option, capsys):
    assert main([*argv, "--help"]) == 0
    assert option in capsys.readouterr().out


def test_measure_autocast_and_torchrun_batches(bert_dir, text_csv, tmp_path, capsys):
    """Two gloo ranks share the batches and get this process's values; autocast."""
    from launch import one_thread, run_python

    base = ["-m", "geosharp.cli", "measure", str(bert_dir), "--data", str(text_csv), *SMALL]
    capsys.readouterr()
    with one_thread():
        assert main([*base[2:], "--json", "-", "--quiet"]) == 0
    single = json.loads(capsys.readouterr().out)
    # under torchrun itself: the command line as a user launches it
    shared = json.loads(run_python([*base, "--json", "-", "--quiet"], 2, torchrun=True))
    for a, b in zip(single["results"], shared["results"]):
        assert a["per_batch"] == b["per_batch"] and a["value"] == b["value"]
    out = tmp_path / "bf16.json"
    assert main([*base[2:], "--json", str(out), "--autocast", "bf16", "--quiet"]) == 0
    row = json.loads(out.read_text())["results"][0]
    assert row["settings"]["autocast"] == "bfloat16" and math.isfinite(row["value"])


def test_out_of_memory_is_one_line(monkeypatch, bert_dir, text_csv, capsys):
    import geosharp.cli.commands

    def oom(args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")

    monkeypatch.setattr(geosharp.cli.commands, "run_measure", oom)
    code = main(["measure", str(bert_dir), "--data", str(text_csv)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "--batch-size" in err


@pytest.mark.parametrize("per", [[], ["--per", "layer"]])
def test_a_value_near_the_round_off_floor_gets_one_line(bert_dir, text_csv, capsys, per):
    """bf16 autocast at a radius far below what it resolves: the command line says so in
    one line, with its own option names, for a whole measure and for blocks alike; at
    a radius it resolves, in float32, no line."""
    base = ["measure", str(bert_dir), "--data", str(text_csv), *SMALL, *per]
    assert main([*base, "--autocast", "bf16", "--rho", "1e-7"]) == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if "round-off floor" in x]
    assert len(lines) == 1 and lines[0].startswith("warning: adaptive")
    assert "(no --autocast)" in lines[0] and "--rho" in lines[0]
    assert main([*base, "--rho", "0.05"]) == 0
    assert "round-off floor" not in capsys.readouterr().err
