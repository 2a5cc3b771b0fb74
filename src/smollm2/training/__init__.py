"""Training: token shards and chat examples (data), one loop for pretraining and fine-tuning (loop), and
checkpoints that survive a crash (state)."""

from .loop import TrainConfig, train

__all__ = ["TrainConfig", "train"]
