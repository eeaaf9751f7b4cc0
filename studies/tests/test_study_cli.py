"""The studies' commands on the ``geosharp`` command line: their options, and every bad
input is one line and exit status 2, checked before any work."""

import pytest

from geosharp.cli import main
from geosharp.errors import UsageError
from test_usage import _one_line_error


@pytest.mark.parametrize(
    "argv, option",
    [
        (["study", "diagonal"], "--networks"),
        (["study", "toy"], "--lim"),
        (["study", "paper"], "--checkpoints"),
        (["study", "pilot"], "--factors"),
        (["zoo"], "--preset"),
    ],
)
def test_every_study_command_shows_its_options(argv, option, capsys):
    assert main([*argv, "--help"]) == 0
    assert option in capsys.readouterr().out


def test_every_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    csv = tmp_path / "data.csv"
    csv.write_text("text,label\ngood,1\n")
    cases = {
        "zoo n-models": (["zoo", "train", "--n-models", "0"], "--n-models"),
        "study paper missing": (
            ["study", "paper", "bert", "--checkpoints", str(tmp_path / "no"), "--data", str(csv)],
            "no such file",
        ),
        "zoo report of nothing": (["zoo", "report", "--out", str(tmp_path / "z")], "at least 2"),
        "diagonal one network": (["study", "diagonal", "--networks", "1"], "--networks"),
        "diagonal batch too big": (
            ["study", "diagonal", "--smoke", "--batch-sizes", "100000"],
            "--batch-sizes",
        ),
    }
    for name, (argv, expected) in cases.items():
        line = _one_line_error(capsys, main(argv))
        assert expected in line, (name, line)


def test_zoo_refuses_a_folder_of_another_preset(tmp_path, capsys):
    from dataclasses import asdict, replace

    from geosharp.io import write_json_atomic
    from geosharp_studies.zoo import PRESETS, check_preset

    smoke = PRESETS[("vision", "smoke")]
    write_json_atomic(tmp_path / "vision" / "preset.json", asdict(smoke))
    code = main(["zoo", "train", "--preset", "full", "--out", str(tmp_path)])
    line = _one_line_error(capsys, code)
    assert "other settings" in line and "n_points" in line
    assert not (tmp_path / "vision" / "models").exists()  # nothing trained
    check_preset(smoke, tmp_path)  # the same preset passes
    check_preset(replace(smoke, n_models=9), tmp_path)  # adding models is allowed
    with pytest.raises(UsageError, match="n_iters"):
        check_preset(replace(smoke, n_iters=7), tmp_path)
    # a zoo made before a setting existed: the setting at its default matches
    older = {k: v for k, v in asdict(smoke).items() if k not in ("secondary", "target")}
    write_json_atomic(tmp_path / "vision" / "preset.json", older)
    check_preset(smoke, tmp_path)
    with pytest.raises(UsageError, match="target"):
        check_preset(replace(smoke, target=0.5), tmp_path)
    # what is measured may grow, never change or shrink
    check_preset(replace(smoke, secondary={"adaptive-attn": "adaptive"}), tmp_path)
    more = (*smoke.measures, "euclidean")
    check_preset(replace(smoke, measures=more, rho_factors=(0.5, 2.0, 4.0)), tmp_path)
    with pytest.raises(UsageError, match="measures"):
        check_preset(replace(smoke, measures=smoke.measures[1:]), tmp_path)
    with pytest.raises(UsageError, match="rho_factors"):
        check_preset(replace(smoke, rho_factors={m: (0.5, 2.0) for m in smoke.measures}), tmp_path)


def test_study_needing_matplotlib_says_so_before_computing(monkeypatch, tmp_path, capsys):
    import sys

    import geosharp_studies.diagonal as diagonal

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(diagonal, "run_study", lambda *a, **k: pytest.fail("computed first"))
    line = _one_line_error(capsys, main(["study", "diagonal", "--smoke", "--out", str(tmp_path)]))
    assert "matplotlib" in line and "--no-plots" in line
    line = _one_line_error(capsys, main(["study", "toy", "--out", str(tmp_path)]))
    assert "matplotlib" in line
    line = _one_line_error(capsys, main(["zoo", "all", "--out", str(tmp_path)]))
    assert "matplotlib" in line and not (tmp_path / "vision").exists()


def test_zoo_seed_noise_is_checked_before_any_work(tmp_path, capsys):
    """--seed-noise: only for a star-design report, and a file with the gap's spread."""
    from geosharp.io import write_json_atomic

    out = ["--out", str(tmp_path)]
    code = main(["zoo", "report", "--preset", "smoke", *out, "--seed-noise", "x.json"])
    assert "star-design" in _one_line_error(capsys, code)
    hparams = ["zoo", "report", "--zoo", "text", "--preset", "hparams", *out]
    code = main([*hparams, "--seed-noise", str(tmp_path / "missing.json")])
    assert "missing.json" in _one_line_error(capsys, code)
    write_json_atomic(tmp_path / "e.json", {"spread": {"error_gap": {"sd": -1}}})
    code = main([*hparams, "--seed-noise", str(tmp_path / "e.json")])
    assert "not a number >= 0" in _one_line_error(capsys, code)
    assert not (tmp_path / "text").exists()  # nothing was started


def test_shared_options_have_one_default():
    from geosharp.cli import build_parser

    parser = build_parser()
    defaults = {}
    for argv in (["measure", "m", "--data", "d"], ["zoo", "train"], ["study", "paper", "bert"]):
        args, _ = parser.parse_known_args([*argv, "--checkpoints", "c", "--data", "d"])
        defaults[argv[0]] = (args.device, getattr(args, "seed", 0))
    assert set(defaults.values()) == {("auto", 0)}
