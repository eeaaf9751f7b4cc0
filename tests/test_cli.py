"""The command line on locally saved checkpoints (nothing downloaded), and the demo."""

import json

from geosharp.cli import main


def test_symmetries_command(bert_dir, capsys):
    assert main(["symmetries", str(bert_dir)]) == 0
    out = capsys.readouterr().out
    assert "encoder.layer.0.attention" in out and "query-key" in out
    assert "self-check OK" in out


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
