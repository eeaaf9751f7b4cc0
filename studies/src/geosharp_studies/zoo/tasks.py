"""What a kind of population is: its data, its model, its loss.

A :class:`Task` is everything training, measurement and the report need to know about
a kind of zoo; they never ask which kind they hold. Two tasks:

* :class:`VisionTask`: tiny Hugging Face ViTs (28x28 inputs, patch 7) trained from
  scratch on Fashion-MNIST (scikit-learn digits resized when the Debian package is
  missing), with label noise and augmentation;
* :class:`TextTask`: the local pre-trained MiniLM BERT (its first ``layers`` layers)
  with a mean-pooling linear head, fine-tuned on Rotten Tomatoes.

Data sets are tuples of tensors whose last entry holds the labels; a model's training
set is a prefix of a pool shuffled once (seed 0), so every model of a zoo shares its
first ``n`` points.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from geosharp.loading.data import move_batch

__all__ = [
    "TASKS",
    "FinetuneTask",
    "MeanPoolClassifier",
    "Task",
    "TextTask",
    "VisionTask",
    "task_for",
]


def noisy_labels(labels: Tensor, noise: float, classes: int, seed: int) -> Tensor:
    """Replace a fraction ``noise`` of the labels by a different random class."""
    if noise <= 0:
        return labels.clone()
    gen = torch.Generator().manual_seed(10_000 + seed)
    flip = torch.rand(len(labels), generator=gen) < noise
    shift = torch.randint(1, classes, (len(labels),), generator=gen)
    return torch.where(flip, (labels + shift) % classes, labels)


class Task:
    """The interface: data, batches, model, loss. Subclasses fill every method."""

    name: str
    setting: str  # one line for the report
    source: str  # the data set's name, for the records
    # the token-embedding module, for tasks whose measurement restricts it to the
    # batches' rows (geosharp.loading.vocabulary.compact_vocabulary); None: no such table
    embedding: str | None = None
    # for models that all start from one pre-trained model: that model's task (which
    # ``train.prepare`` trains with the preset's ``pretrain`` recipe); None: from scratch
    pretrain: Task | None = None

    def train_set(self, hp: dict) -> tuple[Tensor, ...]:
        """The model's training set (with its label noise)."""
        raise NotImplementedError

    def test_set(self, hp: dict, n_test: int) -> tuple[Tensor, ...]:
        """The first ``n_test`` held-out points."""
        raise NotImplementedError

    def batch(self, data: tuple[Tensor, ...], idx, hp: dict | None = None, gen=None):
        """Rows ``idx`` (an index tensor or a slice) of ``data`` as a model batch; with a
        generator, the training-time augmentation of ``hp`` is applied."""
        raise NotImplementedError

    def build_model(self, hp: dict) -> nn.Module:
        """The model before training, exactly reproducible from ``hp`` (its seed)."""
        raise NotImplementedError

    def trainable(self, model: nn.Module, hp: dict) -> list[nn.Parameter]:
        """The parameters training updates."""
        return list(model.parameters())

    def load_model(self, directory: Path) -> nn.Module:
        raise NotImplementedError

    def logits(self, model: nn.Module, batch) -> Tensor:
        raise NotImplementedError

    def labels(self, batch) -> Tensor:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch) -> Tensor:
        """Mean cross-entropy of a batch: the loss every measure perturbs."""
        return F.cross_entropy(self.logits(model, batch), self.labels(batch))

    def train_loss(self, model: nn.Module, batch, hp: dict) -> Tensor:
        """The loss training minimises: cross-entropy with ``hp``'s label smoothing."""
        smoothing = float(hp.get("label_smoothing", 0.0))
        return F.cross_entropy(
            self.logits(model, batch), self.labels(batch), label_smoothing=smoothing
        )

    def use_pretrained(self, model: nn.Module) -> None:
        """Hand the task its pre-trained model (after ``pretrain`` trained it)."""
        raise NotImplementedError

    def batches(self, data: tuple[Tensor, ...], size: int, n: int | None = None) -> list:
        """The first ``n`` points of ``data`` (all by default) in batches of ``size``."""
        n = len(data[-1]) if n is None else min(n, len(data[-1]))
        return [self.batch(data, slice(s, min(s + size, n))) for s in range(0, n, size)]

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, data: tuple, batch_size: int = 256, device=None
    ) -> tuple[float, float]:
        """(error, mean cross-entropy) of ``model`` on ``data``."""
        model.eval()
        wrong, total, n = 0, 0.0, len(data[-1])
        for batch in self.batches(data, batch_size):
            batch = move_batch(batch, device)
            logits, y = self.logits(model, batch), self.labels(batch)
            total += float(F.cross_entropy(logits, y, reduction="sum"))
            wrong += int((logits.argmax(-1) != y).sum())
        return wrong / n, total / n


_VISION_CACHE: dict = {}


def _vision_pool() -> tuple[Tensor, Tensor, Tensor, Tensor, str]:
    """Normalised train pool (shuffled once, seed 0), test set, and the data's name:
    Fashion-MNIST, or (if its Debian package is missing) scikit-learn digits."""
    if "data" not in _VISION_CACHE:
        from geosharp.loading.data import load_digits, load_fashion_mnist

        try:
            train, test = load_fashion_mnist("train"), load_fashion_mnist("test")
            source = "fashion-mnist"
        except FileNotFoundError:
            digits = load_digits()
            digits.images = F.interpolate(digits.images, size=(28, 28), mode="bilinear")
            train, test = digits.split(1297, seed=0)
            source = "digits (Fashion-MNIST missing)"
        order = torch.randperm(len(train.labels), generator=torch.Generator().manual_seed(0))
        _VISION_CACHE["data"] = (
            (train.images[order] - 0.5) / 0.5,
            train.labels[order],
            (test.images - 0.5) / 0.5,
            test.labels,
            source,
        )
    return _VISION_CACHE["data"]


class VisionTask(Task):
    """Tiny ViTs from scratch on Fashion-MNIST; with ``subset``, on those classes only
    (relabelled ``0..len(subset)-1`` in their order)."""

    name = "vision"
    setting = "Fashion-MNIST, tiny ViTs from scratch"

    def __init__(self, subset: tuple[int, ...] | None = None) -> None:
        self.subset = subset
        self.classes = len(subset) if subset else 10
        self._cache: dict = {}

    @property
    def source(self) -> str:
        return self.pool()[4]

    def pool(self) -> tuple[Tensor, Tensor, Tensor, Tensor, str]:
        """Train pool, test set (both restricted to ``subset``) and the data's name."""
        if "data" not in self._cache:
            xtr, ytr, xte, yte, source = _vision_pool()
            if self.subset:
                relabel = torch.full((10,), -1, dtype=torch.long)
                relabel[list(self.subset)] = torch.arange(len(self.subset))
                keep, keep_te = relabel[ytr] >= 0, relabel[yte] >= 0
                xtr, ytr = xtr[keep], relabel[ytr[keep]]
                xte, yte = xte[keep_te], relabel[yte[keep_te]]
                source = f"{source} classes {','.join(map(str, self.subset))}"
            self._cache["data"] = (xtr, ytr, xte, yte, source)
        return self._cache["data"]

    def train_set(self, hp: dict) -> tuple[Tensor, Tensor]:
        xtr, ytr, *_ = self.pool()
        n = min(int(hp["n_train"]), len(ytr))
        noise = float(hp.get("label_noise", 0.0))
        return xtr[:n], noisy_labels(ytr[:n], noise, self.classes, int(hp["seed"]))

    def test_set(self, hp: dict, n_test: int) -> tuple[Tensor, Tensor]:
        _, _, xte, yte, _ = self.pool()
        return xte[:n_test], yte[:n_test]

    def batch(self, data, idx, hp=None, gen=None):
        x, y = data[0][idx], data[1][idx]
        if gen is not None and hp is not None:
            x = augment(x, str(hp.get("augment", "none")), gen)
        return x, y

    def build_model(self, hp: dict) -> nn.Module:
        from geosharp.models.vit import tiny_vit

        width, depth = (int(v) for v in str(hp["arch"]).split("x"))
        return tiny_vit(
            image_size=28,
            channels=1,
            classes=self.classes,
            patch_size=int(hp["patch_size"]),
            hidden=width,
            layers=depth,
            heads=int(hp["heads"]),
            mlp=2 * width,
            seed=int(hp["seed"]),
        )

    def load_model(self, directory: Path) -> nn.Module:
        from transformers import ViTForImageClassification

        from geosharp.loading.hf import quiet_transformers

        with quiet_transformers():
            return ViTForImageClassification.from_pretrained(
                directory, local_files_only=True
            ).eval()

    def logits(self, model, batch) -> Tensor:
        return model(pixel_values=batch[0]).logits

    def labels(self, batch) -> Tensor:
        return batch[1]


class FinetuneTask(VisionTask):
    """Fine-tunes of one ViT pre-trained on Fashion-MNIST classes 0-4, on classes 5-9:
    every model starts from the same pre-trained weights and a seeded new head."""

    name = "vision-finetune"
    setting = "Fashion-MNIST classes 5-9, fine-tunes of one ViT pre-trained on classes 0-4"

    def __init__(self) -> None:
        super().__init__(subset=(5, 6, 7, 8, 9))
        self.pretrain = VisionTask(subset=(0, 1, 2, 3, 4))
        self._backbone: dict[str, Tensor] | None = None

    def use_pretrained(self, model: nn.Module) -> None:
        self._backbone = {
            k: v.detach().clone()
            for k, v in model.state_dict().items()
            if not k.startswith("classifier.")
        }

    def build_model(self, hp: dict) -> nn.Module:
        if self._backbone is None:
            raise RuntimeError("the pre-trained model is not loaded: train.prepare(task, ...)")
        model = super().build_model(hp)  # seeded head
        missing, unexpected = model.load_state_dict(self._backbone, strict=False)
        assert not unexpected and all(k.startswith("classifier.") for k in missing)
        return model


def augment(x: Tensor, mode: str, gen: torch.Generator, max_shift: int = 2) -> Tensor:
    """Random shifts (zero padding, up to ``max_shift`` pixels) and horizontal flips."""
    if mode == "none":
        return x
    out = x
    if "shift" in mode:
        n, _, h, w = x.shape
        padded = F.pad(x, (max_shift,) * 4, value=-1.0)  # -1 is black after normalising
        dy = torch.randint(0, 2 * max_shift + 1, (n,), generator=gen)
        dx = torch.randint(0, 2 * max_shift + 1, (n,), generator=gen)
        rows = (dy[:, None] + torch.arange(h)[None, :])[:, None, :, None]
        cols = (dx[:, None] + torch.arange(w)[None, :])[:, None, None, :]
        idx_n = torch.arange(n)[:, None, None, None]
        out = padded[idx_n, torch.arange(x.shape[1])[None, :, None, None], rows, cols]
    if "flip" in mode:
        flip = torch.rand(len(out), generator=gen) < 0.5
        out = torch.where(flip[:, None, None, None], out.flip(-1), out)
    return out


class TextTask(Task):
    name = "text"
    setting = "Rotten Tomatoes, MiniLM fine-tunes"
    classes = 2
    source = "rotten-tomatoes"
    embedding = "bert.embeddings.word_embeddings"
    n_test_pool = 2000

    def __init__(self) -> None:
        self._cache: dict = {}

    def tokenised(self, max_length: int) -> dict:
        """Tokenised Rotten Tomatoes (shuffled once, seed 0): ``train`` pool and ``test``
        (the last 2,000 sentences of the shuffled set)."""
        if max_length not in self._cache:
            from transformers import AutoTokenizer

            from geosharp.loading.data import load_rotten_tomatoes
            from geosharp.loading.hf import resolve_checkpoint

            data = load_rotten_tomatoes()
            order = torch.randperm(len(data.labels), generator=torch.Generator().manual_seed(0))
            texts = [data.texts[int(i)] for i in order]
            labels = data.labels[order]
            tok = AutoTokenizer.from_pretrained(resolve_checkpoint("minilm"), local_files_only=True)
            n_test = self.n_test_pool

            def encode(ts):
                enc = tok(ts, padding="max_length", truncation=True, max_length=max_length)
                return torch.tensor(enc["input_ids"]), torch.tensor(enc["attention_mask"])

            pool, test = texts[:-n_test], texts[-n_test:]
            self._cache[max_length] = dict(
                train=(*encode(pool[:8000]), labels[:-n_test][:8000]),
                test=(*encode(test), labels[-n_test:]),
            )
        return self._cache[max_length]

    def train_set(self, hp: dict) -> tuple[Tensor, Tensor, Tensor]:
        ids, mask, labels = self.tokenised(int(hp["max_length"]))["train"]
        n = min(int(hp["n_train"]), len(labels))
        noise = float(hp.get("label_noise", 0.0))
        return ids[:n], mask[:n], noisy_labels(labels[:n], noise, self.classes, int(hp["seed"]))

    def test_set(self, hp: dict, n_test: int) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(t[:n_test] for t in self.tokenised(int(hp["max_length"]))["test"])

    unk_id = 100  # MiniLM's [UNK]
    special_ids = (0, 101, 102)  # [PAD], [CLS], [SEP]

    def batch(self, data, idx, hp=None, gen=None) -> dict:
        """With a generator, ``hp["word_dropout"]`` replaces that fraction of the
        sentence's tokens (not [PAD], [CLS], [SEP]) by [UNK]."""
        ids, mask, labels = (t[idx] for t in data)
        rate = float(hp.get("word_dropout", 0.0)) if hp is not None else 0.0
        if gen is not None and rate > 0:
            drop = torch.rand(ids.shape, generator=gen) < rate
            drop &= ~torch.isin(ids, torch.tensor(self.special_ids))
            ids = torch.where(drop, torch.full_like(ids, self.unk_id), ids)
        keep = int(mask.sum(1).max())  # drop all-padding columns
        return {"input_ids": ids[:, :keep], "attention_mask": mask[:, :keep], "labels": labels}

    def build_model(self, hp: dict) -> nn.Module:
        from transformers import BertModel

        from geosharp.loading.hf import quiet_transformers, resolve_checkpoint

        with quiet_transformers(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(hp["seed"]))
            bert = BertModel.from_pretrained(
                resolve_checkpoint("minilm"),
                add_pooling_layer=False,
                local_files_only=True,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
            model = MeanPoolClassifier(bert, num_labels=self.classes)
        n_layers = int(hp["layers"])
        model.bert.encoder.layer = model.bert.encoder.layer[:n_layers]
        model.config.num_hidden_layers = n_layers
        return model

    def trainable(self, model, hp: dict) -> list[nn.Parameter]:
        frozen = set()
        if hp.get("freeze_embeddings"):
            frozen = {id(p) for p in model.bert.embeddings.parameters()}
        return [p for p in model.parameters() if id(p) not in frozen]

    def load_model(self, directory: Path) -> nn.Module:
        return MeanPoolClassifier.load(Path(directory)).eval()

    def logits(self, model, batch) -> Tensor:
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits

    def labels(self, batch) -> Tensor:
        return batch["labels"]


class MeanPoolClassifier(nn.Module):
    """A BERT encoder, the mean of its last hidden states over the non-padding tokens,
    and a linear classifier: the head MiniLM (a sentence-transformers model) was trained
    for. After one layer its ``[CLS]`` state carries no sentence information (a linear
    probe on it scores the majority-class rate on Rotten Tomatoes, one on the mean 75%),
    and ``BertForSequenceClassification`` fine-tuned from it predicts the majority
    class."""

    def __init__(self, bert, num_labels: int = 2):
        super().__init__()
        self.bert = bert
        self.config = bert.config
        self.config.num_labels = num_labels
        self.classifier = nn.Linear(bert.config.hidden_size, num_labels)

    def forward(self, input_ids: Tensor, attention_mask: Tensor):
        from transformers.modeling_outputs import SequenceClassifierOutput

        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        return SequenceClassifierOutput(logits=self.classifier(pooled))

    @classmethod
    def load(cls, directory: Path) -> MeanPoolClassifier:
        from safetensors.torch import load_model
        from transformers import BertConfig, BertModel

        config = BertConfig.from_pretrained(directory, local_files_only=True)
        model = cls(BertModel(config, add_pooling_layer=False), num_labels=config.num_labels)
        load_model(model, str(directory / "model.safetensors"))
        return model


TASKS: dict[str, Task] = {
    "vision": VisionTask(),
    "text": TextTask(),
    "vision-finetune": FinetuneTask(),
}


def task_for(zoo: str) -> Task:
    """The task of a zoo kind (``vision``, ``text`` or ``vision-finetune``)."""
    return TASKS[zoo]
