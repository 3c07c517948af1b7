"""The LightningModule of bench/lightning_fast.py (imported once its options are checked): ddp-cifar's
net, training step, per-epoch test accuracy and optimizer, as a Lightning user writes them."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import torch
from torch import nn

from ddp import metrics, models, optim
from ddp.config import Config


class FastNet(pl.LightningModule):
    """The training step, the per-epoch test accuracy and the optimizer of ddp/train.py's recipe."""

    def __init__(self, cfg: Config, num_classes: int, steps_per_epoch: int) -> None:
        super().__init__()
        self.cfg, self.steps_per_epoch = cfg, steps_per_epoch
        self.net = models.build(cfg.model.name, num_classes, cfg.model.dropout, cfg.model.width)
        if cfg.run.channels_last:
            self.net = self.net.to(memory_format=torch.channels_last)
        if cfg.optim.freeze_norm_weights:  # before Lightning's DDP wrap, as ddp/train.py freezes before its own
            optim.freeze_norm_weights(self.net)
        self.loss = nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)
        self.correct = self.seen = 0
        self.epochs: list[dict] = []
        self.epoch_started = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.run.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return self.loss(self(x), y)

    def on_train_epoch_start(self) -> None:
        metrics.synchronize(self.device)
        self.epoch_started = time.perf_counter()

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        x, y = batch
        logits = self(x)
        if self.cfg.train.tta_flip:
            logits = logits + self(x.flip(3))
        self.correct += int((logits.argmax(1) == y).sum())
        self.seen += len(y)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            self.correct = self.seen = 0
            return
        seconds = metrics.elapsed(self.epoch_started, self.device)
        self.epochs.append({"epoch": self.current_epoch + 1, "seconds": seconds, "test_acc": self.correct / self.seen})
        print(f"  lightning epoch {self.current_epoch + 1}: {self.correct / self.seen:.1%} in {seconds:.1f} s")
        self.correct = self.seen = 0

    def configure_optimizers(self):  # noqa: ANN201 (Lightning's own return shape)
        total = self.steps_per_epoch * self.cfg.train.epochs
        optimizer, schedule = optim.make_optimizer(self.net, self.cfg.optim, total, self.steps_per_epoch)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
