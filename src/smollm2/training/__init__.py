"""Training: token shards, chat examples and preference pairs (data), one loop for pretraining, fine-tuning and
DPO (loop, with loss and dpo), checkpoints that survive a crash (state), and the runs the command line starts,
each a function (runs: pretrain, finetune, train_dpo)."""

from .dpo import DPOSettings
from .loop import TrainConfig, train
from .runs import finetune, pretrain, train_dpo
from .tuning import LoRASettings, model_to_tune

__all__ = ["DPOSettings", "LoRASettings", "TrainConfig", "finetune", "model_to_tune", "pretrain", "train", "train_dpo"]
