"""compact_vocabulary: exact against the whole table, never changes the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import geosharp
from geosharp import UsageError, sharpness
from geosharp.loading.vocabulary import compact_vocabulary
from zoo import bert_case

TABLE = "bert.embeddings.word_embeddings"


def _subset_case():
    case = bert_case()
    case.model.eval()
    for b in case.batches:  # tokens 3..14 only: rows 0-2 and 15-49 are never used
        b["input_ids"] = b["input_ids"] % 12 + 3
    return case


@pytest.mark.parametrize("measure", ["adaptive", "adaptive-linf", "geodesic-inv", "geodesic-mix"])
def test_same_worst_case_as_the_whole_table(measure):
    case = _subset_case()
    full = sharpness(
        case.model,
        case.batches,
        case.loss_fn,
        measure,
        rho=0.05,
        estimator=geosharp.WorstCase(n_iters=6),
    )
    before = case.model.get_submodule(TABLE)
    with compact_vocabulary(case.model, case.batches) as batches:
        table = case.model.get_submodule(TABLE)
        assert table.num_embeddings == 12
        compact = sharpness(
            case.model,
            batches,
            case.loss_fn,
            measure,
            rho=0.05,
            estimator=geosharp.WorstCase(n_iters=6),
        )
    assert case.model.get_submodule(TABLE) is before
    assert compact.value == pytest.approx(full.value, rel=1e-10, abs=1e-14)
    assert compact.value > 0


def test_model_restored_and_unchanged_when_the_block_raises():
    case = _subset_case()
    table = case.model.get_submodule(TABLE)
    weight = table.weight.detach().clone()
    with pytest.raises(RuntimeError, match="boom"):
        with compact_vocabulary(case.model, case.batches) as batches:
            assert batches[0]["input_ids"].max() < 12
            assert batches[0]["attention_mask"] is case.batches[0]["attention_mask"]
            case.model.get_submodule(TABLE).weight.data.add_(1.0)
            raise RuntimeError("boom")
    assert case.model.get_submodule(TABLE) is table
    assert torch.equal(table.weight, weight)
    assert case.batches[0]["input_ids"].max() >= 12  # the caller's batches are not remapped


def test_padding_row_is_kept_as_padding():
    emb = nn.Sequential(nn.Embedding(10, 3, padding_idx=4))
    with compact_vocabulary(emb, [torch.tensor([[9, 4, 2]])], embedding="0") as (ids,):
        assert ids.tolist() == [[2, 1, 0]]
        assert emb[0].padding_idx == 1
    with compact_vocabulary(emb, [torch.tensor([[9, 2]])], embedding="0"):
        assert emb[0].padding_idx is None


def test_user_errors():
    from zoo import _gpt2

    gpt2 = _gpt2()
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(UsageError, match=r"tied to lm_head\.weight"):
        with compact_vocabulary(gpt2, [{"input_ids": ids}]):
            pass
    model = nn.Sequential(nn.Embedding(5, 2), nn.Linear(2, 2))
    with pytest.raises(UsageError, match=r"not an nn\.Embedding"):
        with compact_vocabulary(model, [ids], embedding="1"):
            pass
    with pytest.raises(UsageError, match="no submodule 'x'"):
        with compact_vocabulary(model, [ids], embedding="x"):
            pass
    with pytest.raises(UsageError, match="cannot tell which module"):
        with compact_vocabulary(model, [ids]):
            pass
    with pytest.raises(UsageError, match="table has 5 rows"):
        with compact_vocabulary(model, [torch.tensor([[7]])], embedding="0"):
            pass
    with pytest.raises(UsageError, match="without 'input_ids'"):
        with compact_vocabulary(model, [(ids,)], embedding="0"):
            pass
