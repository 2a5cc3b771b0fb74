"""Training: token shards, chat examples and preference pairs (data), one loop for pretraining, fine-tuning and
DPO (loop, with loss and dpo), and checkpoints that survive a crash (state)."""

from .loop import TrainConfig, train
from .tuning import LoRASettings, model_to_tune

__all__ = ["LoRASettings", "TrainConfig", "model_to_tune", "train"]
