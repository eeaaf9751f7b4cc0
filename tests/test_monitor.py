"""Sharpness during training: the plain hook and the Hugging Face Trainer callback,
run with a real ``Trainer`` on a tiny BERT."""

import copy

import numpy as np
import pytest
import torch

from geosharp.training.monitor import SharpnessMonitor
from zoo import vit_case


def test_monitor_returns_metrics_and_leaves_the_model_alone():
    case = vit_case(torch.float64)
    before = copy.deepcopy(case.model.state_dict())
    case.model.train()
    monitor = SharpnessMonitor(
        case.batches, case.loss_fn, measures=["adaptive", "geodesic-inv"], n_iters=2
    )
    metrics = monitor(case.model, step=3)
    assert set(metrics) == {"sharpness/adaptive", "sharpness/geodesic-inv", "sharpness/loss"}
    assert all(v > 0 for v in metrics.values())
    assert monitor.history == [{"step": 3, **metrics}]
    assert case.model.training  # flags restored
    after = case.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert monitor(case.model) == metrics  # fixed batches and seed: repeatable


def test_monitor_checks_its_arguments_up_front():
    case = vit_case(torch.float64)
    with pytest.raises(ValueError, match="unknown measure"):
        SharpnessMonitor(case.batches, case.loss_fn, measures=["sharp"])
    with pytest.raises(ValueError, match="empty"):
        SharpnessMonitor([], case.loss_fn)
    with pytest.raises(ValueError, match="not in measures"):
        SharpnessMonitor(case.batches, case.loss_fn, measures=["adaptive"], rho={"euclidean": 1})


class _Dataset(torch.utils.data.Dataset):
    def __init__(self, n=16, length=6, vocab=20, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(5, vocab, (n, length), generator=gen)
        self.labels = torch.randint(0, 2, (n,), generator=gen)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones_like(self.ids[i]),
            "labels": self.labels[i],
        }


def test_trainer_callback_logs_with_the_trainer_s_metrics(tmp_path):
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from geosharp.training.callbacks import SharpnessCallback

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=20,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=2,
        max_position_embeddings=16,
    )
    model = BertForSequenceClassification(config)
    train = _Dataset()

    class Logger(TrainerCallback):  # stands for TensorBoard / W&B / CSV loggers
        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    logger = Logger()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=8,
        logging_steps=2,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[logger])
    batches = [
        {k: torch.stack([train[i][k] for i in range(s, s + 4)]) for k in train[0]} for s in (0, 4)
    ]
    callback = SharpnessCallback(batches, measures=["geodesic-inv"], every_n_steps=2, n_iters=2)
    callback.attach(trainer)
    trainer.train()

    logged = [entry for entry in logger.logs if "sharpness/geodesic-inv" in entry]
    assert len(logged) == 2  # steps 2 and 4
    history = [e for e in trainer.state.log_history if "sharpness/geodesic-inv" in e]
    assert [e["step"] for e in history] == [2, 4]
    assert all(e["sharpness/geodesic-inv"] > 0 for e in history)
    assert [h["step"] for h in callback.history] == [2, 4]

    metrics = trainer.evaluate(eval_dataset=train)  # at_evaluate: added to the metrics
    assert "sharpness/geodesic-inv" in metrics and "eval_loss" in metrics
    assert [h["step"] for h in callback.history] == [2, 4]  # step 4 measured once

    # passed in callbacks=[...] without attach: the values still reach the log history
    plain = SharpnessCallback(batches, measures=["adaptive"], every_n_steps=4, n_iters=1)
    again = Trainer(model=model, args=args, train_dataset=train, callbacks=[plain])
    again.train()
    history = [e for e in again.state.log_history if "sharpness/adaptive" in e]
    assert [e["step"] for e in history] == [4] and len(plain.history) == 1


def _tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, num_labels=2, max_position_embeddings=16,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    return BertForSequenceClassification(config)


def test_geodesic_sam_trains_inside_a_trainer(tmp_path):
    """A real Trainer step with GeodesicSAMTrainer is GeodesicSAM's closure step with the
    same AdamW (the Trainer calls optimizer.step() without a closure)."""
    from transformers import TrainingArguments

    from geosharp.training.callbacks import GeodesicSAMTrainer
    from geosharp.training.optim import GeodesicSAM

    model, train = _tiny_bert(), _Dataset(n=8)
    reference = copy.deepcopy(model)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8,
                             learning_rate=1e-2, weight_decay=0.0, max_grad_norm=0.0,
                             optim="adamw_torch", lr_scheduler_type="constant", report_to="none",
                             save_strategy="no", use_cpu=True, disable_tqdm=True)  # fmt: skip
    trainer = GeodesicSAMTrainer(model=model, args=args, train_dataset=train, sam_rho=0.1)
    trainer.train()
    assert isinstance(getattr(trainer.optimizer, "optimizer", trainer.optimizer), GeodesicSAM)

    batch = {k: torch.stack([train[i][k] for i in range(8)]) for k in train[0]}
    sam = GeodesicSAM(reference, torch.optim.AdamW, rho=0.1, lr=1e-2, weight_decay=0.0)
    reference.train()

    def closure():
        loss = reference(**batch).loss
        loss.backward()
        return loss

    sam.step(closure)
    moved = [(p - q).abs().max() for p, q in zip(model.parameters(), reference.parameters())]
    assert max(moved) < 1e-5  # the Trainer's batch order sums the loss in another order
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), _tiny_bert().parameters()))


def test_training_integrations_check_their_settings_when_built():
    from transformers import TrainingArguments

    from geosharp.training.callbacks import GeodesicSAMTrainer, SharpnessCallback
    from geosharp.training.optim import GeodesicSAM

    case = vit_case(torch.float64)
    for bad, error in [
        (dict(rho=-1), "rho must be a positive"),
        (dict(rho=0), "rho must be a positive"),
        (dict(n_iters=0), "n_iters must be a positive integer"),
        (dict(n_iters=2.5), "n_iters must be a positive integer"),
        (dict(estimate="worst"), "unknown option"),
    ]:
        with pytest.raises((ValueError, TypeError), match=error):
            SharpnessMonitor(case.batches, case.loss_fn, **bad)
        with pytest.raises((ValueError, TypeError), match=error):
            SharpnessCallback(case.batches, case.loss_fn, every_n_steps=5, **bad)
    with pytest.raises(ValueError, match="every_n_steps"):
        SharpnessCallback(case.batches, case.loss_fn, every_n_steps=0)
    monitor = SharpnessMonitor(case.batches, case.loss_fn, rho=np.float32(0.05), n_iters=1)
    with pytest.raises(TypeError, match="load it first"):
        monitor("bert-base-uncased")
    with torch.device("meta"):
        meta = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="meta device"):
        monitor(meta)

    model = _tiny_bert()
    assert GeodesicSAM(model, torch.optim.SGD, rho=np.float64(0.05), lr=0.1).rho == 0.05
    assert (
        GeodesicSAM(model, torch.optim.SGD, rho=torch.tensor(0.05, dtype=torch.float64), lr=0.1).rho
        == 0.05
    )
    other = torch.optim.SGD(_tiny_bert().parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"does not hold .* would not be trained"):
        GeodesicSAM(model, other)
    with pytest.raises(ValueError, match="without a closure needs first_step"):
        GeodesicSAM(model, torch.optim.SGD, lr=0.1).step()
    args = TrainingArguments(output_dir="unused", gradient_accumulation_steps=2, report_to="none",
                             use_cpu=True)  # fmt: skip
    with pytest.raises(ValueError, match="gradient_accumulation_steps=1"):
        GeodesicSAMTrainer(model=model, args=args)
    with pytest.raises(ValueError, match="sam_rho"):
        GeodesicSAMTrainer(model=model, args=args, sam_rho=-1)


def test_the_schedule_reaches_the_base_optimizer(tmp_path):
    """GeodesicSAM(rho=0) is its base optimizer step for step: under a Trainer's default
    linear schedule (accelerate reloads the optimizer's state when it prepares it), and
    under StepLR across a load_state_dict (resuming training)."""
    from transformers import Trainer, TrainingArguments

    from geosharp.training.callbacks import GeodesicSAMTrainer
    from geosharp.training.optim import GeodesicSAM

    train = _Dataset(n=8)
    args = dict(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                learning_rate=1e-2, weight_decay=0.0, max_grad_norm=0.0, optim="adamw_torch",
                report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
                seed=0)  # fmt: skip
    plain, sam = _tiny_bert(), _tiny_bert()
    Trainer(model=plain, args=TrainingArguments(**args), train_dataset=train).train()
    trainer = GeodesicSAMTrainer(
        model=sam, args=TrainingArguments(**args), train_dataset=train, sam_rho=0.0
    )
    trainer.train()
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert inner.base_optimizer.param_groups[0]["lr"] == 0.0  # the schedule's end
    assert max((p - q).abs().max() for p, q in zip(plain.parameters(), sam.parameters())) < 1e-6

    models = [_tiny_bert(), _tiny_bert()]
    base = torch.optim.SGD(models[0].parameters(), lr=0.1)
    wrapped = GeodesicSAM(models[1], torch.optim.SGD, rho=0.0, measure="adaptive", lr=0.1)
    schedules = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.125) for o in (base, wrapped)]
    batch = {k: torch.stack([train[i][k] for i in range(8)]) for k in train[0]}
    for step in range(3):
        base.zero_grad()
        models[0](**batch).loss.backward()
        base.step()
        wrapped.zero_grad()
        wrapped.step(lambda: models[1](**batch).loss.backward())
        for schedule in schedules:
            schedule.step()
        if step == 0:
            wrapped.load_state_dict(wrapped.state_dict())  # resuming: new param_groups
    assert wrapped.param_groups is wrapped.base_optimizer.param_groups
    assert wrapped.base_optimizer.param_groups[0]["lr"] == base.param_groups[0]["lr"] == 0.1 / 8**3
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
