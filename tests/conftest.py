"""Shared test set-up: test helpers (``zoo``, references) import as plain modules."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GEOSHARP_STRICT_TRACE", "1")  # a tracer bug fails the test
if os.environ.get("PYTEST_XDIST_WORKER"):  # one thread per worker: no oversubscription
    torch.set_num_threads(1)

from zoo import ARCHITECTURES, CASES

WORDS = "good bad great awful film movie plot actor fun dull boring superb the a is was".split()


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory):
    """A tiny BERT sequence classifier (2 labels) with its tokenizer, saved to disk."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    path = tmp_path_factory.mktemp("bert")
    vocab = path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]))
    tokenizer = BertTokenizerFast(vocab=str(vocab))
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
        id2label={0: "negative", 1: "positive"},
        label2id={"negative": 0, "positive": 1},
    )
    BertForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def vit_dir(tmp_path_factory):
    """A tiny ViT image classifier (8x8 grey images, 10 labels), saved to disk."""
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


@pytest.fixture(scope="session")
def text_csv(tmp_path_factory):
    """16 labelled sentences in a CSV with ``text,label`` columns."""
    path = tmp_path_factory.mktemp("data") / "data.csv"
    rows = ["text,label"] + [f"the film was {w},{i % 2}" for i, w in enumerate(WORDS)]
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(params=sorted(CASES))
def case(request):
    """Each model of the float64 case zoo (``zoo.CASES``): BERT, ViT, an encoder."""
    return CASES[request.param](dtype=torch.float64)


@pytest.fixture(params=list(ARCHITECTURES))
def architecture(request):
    """Each supported attention layout (``zoo.ARCHITECTURES``)."""
    return ARCHITECTURES[request.param]
