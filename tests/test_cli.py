"""The command line on locally saved checkpoints (nothing downloaded), and the demo."""

import json
import re

from geosharp.cli import main


def test_symmetries_command(bert_dir, capsys):
    assert main(["symmetries", str(bert_dir)]) == 0
    out = capsys.readouterr().out
    assert "encoder.layer.0.attention" in out and "query-key" in out
    assert "2 of 2 verified" in out and re.search(r"verified \d+e-\d+", out)
    assert "self-check OK" in out


def test_symmetries_without_weights(bert_dir, capsys):
    """--no-weights: the architecture of config.json on the meta device, traced on
    shapes only; the pairs are found and marked unverified."""
    assert main(["symmetries", str(bert_dir), "--no-weights"]) == 0
    out = capsys.readouterr().out
    assert "encoder.layer.0.attention" in out and "0 of 2 verified" in out
    assert "unverified" in out and "self-check" not in out


def test_measure_marks_values_that_are_not_symmetry_correct(
    bert_dir, text_csv, monkeypatch, capsys
):
    """A model whose attention runs in a kernel the trace cannot see (simulated
    flash-attention): the geodesic value is marked, one line says why; --strict stops
    before measuring, with exit 2."""
    from torch.nn import functional as F

    from zoo import opaque_sdpa

    monkeypatch.setattr(F, "scaled_dot_product_attention", opaque_sdpa)
    args = ["measure", str(bert_dir), "--data", str(text_csv), "--n-points", "8",
            "--batch-size", "8", "--n-iters", "1",
            "--measures", "adaptive,geodesic-inv"]  # fmt: skip
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "geodesic-inv (no pairs)" in captured.out
    assert "adaptive " in captured.out and "adaptive (" not in captured.out
    warning = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "fused_attention" in warning[0]
    assert main([*args, "--strict"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("geosharp: error:") and "--strict" in err[0]


def test_measure_text_csv_json(bert_dir, text_csv, tmp_path, capsys):
    out_json = tmp_path / "out.json"
    code = main(
        [
            "measure",
            str(bert_dir),
            "--data",
            str(text_csv),
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
    assert payload["new_parameters"] == []  # the checkpoint has its head
    found = payload["symmetries"]
    assert found["discovery"] == "trace" and found["pairs"] == 4 and found["ignored"] == []
    assert len(found["verified"]) == found["pair_blocks"] == 2


def test_measure_low_memory_was_removed(bert_dir, text_csv, capsys):
    """``--low-memory``'s memory is the default: the flag stops before anything slow,
    naming the fix."""
    args = ["measure", str(bert_dir), "--data", str(text_csv), "--low-memory"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "drop the flag" in err


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
    payload = json.loads(capsys.readouterr().out)  # only JSON on stdout
    assert payload["results"][0]["geometry"] == "geodesic-inv"


def test_demo_quick(capfd):
    from geosharp.cli.demo import run_demo

    lines = []
    assert run_demo(epochs=2, n_iters=3, print_fn=lines.append) == 0
    assert "[transformers]" not in capfd.readouterr().err  # the tiny configs' notes
    table = {
        line.split()[0] + (" " + line.split()[1] if line.startswith("geodesic") else ""): line
        for line in lines
        if line.startswith(("adaptive", "geodesic", "euclidean"))
    }
    assert "yes" in table["geodesic inv"] and "yes" in table["geodesic mix"]
    assert "NO" in table["adaptive"]


def test_measure_hessian_traces_beside_sharpness(bert_dir, text_csv, tmp_path, capsys):
    out_json = tmp_path / "out.json"
    args = ["measure", str(bert_dir), "--data", str(text_csv), "--n-points", "8"]
    args += ["--batch-size", "8", "--n-iters", "2", "--n-probes", "3", "--json", str(out_json)]
    code = main([*args, "--measures", "hessian-trace-inv,adaptive", "--rho", "0.02"])
    assert code == 0
    assert "hessian-trace-inv" in capsys.readouterr().out
    rows = {r["measure"]: r for r in json.loads(out_json.read_text())["results"]}
    trace = rows["hessian-trace-inv"]
    assert trace["rho"] is None and len(trace["per_probe"]) == 3 and trace["stderr"] >= 0
    assert rows["adaptive"]["rho"] == 0.02
    code = main([*args, "--measures", "hessian-trace-inv", "--rho", "hessian-trace-inv=0.1"])
    assert code == 2
    assert "has no radius" in capsys.readouterr().err


def test_measure_per_layer_with_plot(bert_dir, text_csv, tmp_path, capsys):
    """--per layer: each layer's sharpness with the rest fixed, a table line per (measure,
    block), the blocks in the JSON, and a bar chart; --plot without --per and --per with
    a Hessian trace are one-line errors."""
    from PIL import Image

    plot, out = tmp_path / "layers.png", tmp_path / "layers.json"
    args = ["measure", str(bert_dir), "--data", str(text_csv), "--n-points", "8",
            "--batch-size", "8", "--n-iters", "2", "--measures", "adaptive,geodesic-inv",
            "--per", "layer"]  # fmt: skip
    assert main([*args, "--plot", str(plot), "--json", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    rows = json.loads(out.read_text())["results"]
    blocks = list(rows[0]["values"])
    assert "bert.encoder.layer.0" in blocks and "classifier" in blocks
    assert [list(r["values"]) for r in rows] == [blocks, blocks]
    assert all(v > 0 for r in rows for v in r["values"].values())
    assert len(table) == 1 + 2 * len(blocks) and "geodesic-inv" in table[-1]
    with Image.open(plot) as image:
        assert image.size[0] > 300
    assert main([*args[:-2], "--plot", str(plot)]) == 2
    assert "--per layer" in capsys.readouterr().err
    assert main([*args, "--measures", "hessian-trace-inv"]) == 2
    assert "drop hessian-trace-inv" in capsys.readouterr().err


def test_plot_writes_every_format_it_accepts_and_never_over_the_json(
    bert_dir, text_csv, tmp_path, capsys
):
    """--plot out.svg is written by matplotlib (it was accepted, then failed after the
    measure); --json and --plot naming one file is refused before measuring."""
    args = ["measure", str(bert_dir), "--data", str(text_csv), "--n-points", "8",
            "--batch-size", "8", "--n-iters", "1", "--measures", "adaptive",
            "--per", "layer", "--quiet"]  # fmt: skip
    svg = tmp_path / "layers.svg"
    assert main([*args, "--plot", str(svg)]) == 0
    assert "<svg" in svg.read_text()
    capsys.readouterr()
    same = tmp_path / "x.png"
    assert main([*args, "--json", str(same), "--plot", str(same)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--json and --plot both name" in err and err.count("\n") == 0
    assert not same.exists()
    assert main([*args, "--plot", str(tmp_path / "layers.docx")]) == 2
    assert "not a figure format" in capsys.readouterr().err


def test_version(capsys):
    from geosharp import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"geosharp {__version__}"


def test_study_commands_without_the_studies_package_say_how_to_install(monkeypatch, capsys):
    import geosharp.cli

    monkeypatch.setattr(geosharp.cli, "plugins", list)
    assert geosharp.cli.build_parser().commands == {"demo", "measure", "symmetries"}
    assert geosharp.cli.main(["zoo", "train"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install -e studies/" in err
