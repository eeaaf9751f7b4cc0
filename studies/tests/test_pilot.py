"""The study pilot: linearity ratios tell the first-order regime from curvature."""

import pytest
import torch
from torch import nn

from geosharp_studies.pilot import maximiser_check, primary_factor, radius_pilot
from zoo import encoder_case


def _least_squares_at_its_minimum():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=gen, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.3 * torch.randn(
        64, generator=gen, dtype=torch.float64
    )
    model = nn.Linear(3, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.linalg.lstsq(x, y.unsqueeze(1)).solution.T)
    return model, [(x, y)], lambda m, b: ((m(b[0]).squeeze(1) - b[1]) ** 2).mean()


def test_ratio_is_four_at_a_minimum_and_two_away_from_it():
    model, batches, loss = _least_squares_at_its_minimum()
    at_min = radius_pilot(model, batches, loss, ["adaptive"], factors=(1, 2, 4), n_iters=10)
    assert at_min["adaptive"]["ratio"] == pytest.approx([4.0, 4.0], rel=1e-3)  # quadratic
    assert primary_factor(at_min["adaptive"]) == 1

    case = encoder_case()  # random weights: far from a minimum, small radii
    away = radius_pilot(
        case.model, case.batches, case.loss_fn, ["adaptive"], factors=(0.01, 0.02), n_iters=5
    )
    assert away["adaptive"]["ratio"][0] == pytest.approx(2.0, rel=0.05)  # linear
    assert primary_factor(away["adaptive"]) is None
    with pytest.raises(ValueError, match="double"):
        radius_pilot(model, batches, loss, ["adaptive"], factors=(1, 3))


def test_maximiser_check_on_a_quadratic():
    model, batches, loss = _least_squares_at_its_minimum()
    check = maximiser_check(model, batches, loss, "adaptive", rho=0.05, n_iters=10, long_iters=30)
    assert check["value"] > 0 and check["move_long"] < 0.02 and check["move_starts"] < 0.02


def test_pilot_command_writes_its_record(tmp_path, monkeypatch, capsys):
    import json

    from transformers import BertConfig, BertModel

    from geosharp.cli import main
    from geosharp_studies import zoo

    def tiny_train_one(hp, kind, n_test, device=None):
        torch.manual_seed(0)
        config = BertConfig(
            hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16
        )
        model = zoo.MeanPoolClassifier(BertModel(config, add_pooling_layer=False)).eval()
        return model, {"train_error": 0.5, "hyperparameters": hp}

    monkeypatch.setattr(zoo.train, "train_one", tiny_train_one)  # what the pilot imports
    argv = ["study", "pilot", "--out", str(tmp_path), "--factors", "1", "2", "--n-points", "8"]
    assert main([*argv, "--n-iters", "2", "--long-iters", "3", "--starts", "2"]) == 0
    record = json.loads((tmp_path / "pilot.json").read_text())
    assert set(record["radius_pilot"]) == {"adaptive", "geodesic-inv", "geodesic-mix"}
    for check in record["maximiser"].values():
        assert check["value"] > 0 and check["starts"] == 2 and check["long_iters"] == 3
    assert record["unperturbed"] == ["bert.embeddings.word_embeddings.weight"]
    assert "maximiser" in json.loads(capsys.readouterr().out)
