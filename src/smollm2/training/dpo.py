"""Direct Preference Optimization (Rafailov et al., 2023): learn from pairs of a preferred and a rejected answer,
without a reward model, by raising the policy's log-probability margin between the two above the reference's.

The reference is the model training starts from. Its log-probabilities of every pair are computed once, before
training (reference_logps), and stored with the data: no second model is kept, and with LoRA the reference is
the base exactly, since a fresh adapter (B = 0) changes nothing. The loss is TRL's "sigmoid" DPO loss, with the
label smoothing of conservative DPO (cDPO), the mean over pairs.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import SmolError
from .loss import IGNORE
from .tuning import process_device


@dataclass(frozen=True)
class DPOSettings:
    beta: float = 0.1  # how far the policy may move from the reference
    label_smoothing: float = 0.0  # the share of pairs assumed mislabelled (conservative DPO)

    def __post_init__(self):
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise SmolError(f"--beta must be a number > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise SmolError(f"--label-smoothing must be in [0, 0.5), got {self.label_smoothing}")


def sequence_logps(model, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its scored tokens (labels != IGNORE); inputs, labels: (N, T).

    Logits are made for the scored positions alone, the answers: the prompts' (tokens x vocab) are never needed."""
    scored = labels != IGNORE
    h = model.hidden_states(inputs)[scored]  # (answer tokens, C)
    logps = F.linear(h, model.output_weight).float().log_softmax(-1)
    token_logps = logps.gather(-1, labels[scored][:, None])[:, 0]
    return torch.zeros(len(inputs), dtype=token_logps.dtype, device=inputs.device).index_add(
        0, scored.nonzero()[:, 0], token_logps)


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor, beta: float,
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: the loss -(1 - e) log sigmoid(beta m) - e log sigmoid(-beta m), where m is the policy's log-ratio
    of chosen to rejected minus the reference's, and the implicit rewards beta (policy - reference) of the chosen
    and the rejected answer (detached: they are for metrics)."""
    margin = (policy_chosen_logps - policy_rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    losses = -(1 - label_smoothing) * F.logsigmoid(beta * margin) - label_smoothing * F.logsigmoid(-beta * margin)
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps).detach()
    return losses, chosen_rewards, rejected_rewards


class DPOLoss(nn.Module):
    """A model and its DPO loss as one module, for the training loop (see loss.NextTokenLoss)."""

    metrics = ("loss", "reward_accuracy", "chosen_reward", "rejected_reward", "reward_margin")
    perplexity = False  # exp of a DPO loss is no perplexity

    def __init__(self, model, settings: DPOSettings = DPOSettings()):
        super().__init__()
        self.model, self.beta, self.label_smoothing = model, settings.beta, settings.label_smoothing

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor, reference: torch.Tensor) -> dict[str, torch.Tensor]:
        """inputs, labels: (B, 2, T), [:, 0] the chosen side, [:, 1] the rejected; reference: (B, 2) their
        log-probabilities under the reference model. Sums over the B pairs: the loss, reward accuracy (the chosen
        answer's reward above the rejected's), the rewards and their margin."""
        policy = sequence_logps(self.model, inputs.flatten(0, 1), labels.flatten(0, 1)).view(-1, 2)  # one pass
        losses, chosen, rejected = dpo_loss(policy[:, 0], policy[:, 1], reference[:, 0], reference[:, 1], self.beta,
                                            self.label_smoothing)
        return {"loss": losses.sum(), "reward_accuracy": (chosen > rejected).float().sum(),
                "chosen_reward": chosen.sum(), "rejected_reward": rejected.sum(),
                "reward_margin": (chosen - rejected).sum()}

    @staticmethod
    def count(batch: tuple[torch.Tensor, ...]) -> int:
        """The loss is a mean over pairs."""
        return len(batch[0])

    @staticmethod
    def projected(batch: tuple[torch.Tensor, ...]) -> int:
        """How many positions the output projection takes: the answers' tokens alone."""
        return int((batch[1] != IGNORE).sum())


@torch.no_grad()
def reference_logps(model, data, batch_size: int = 8, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """Every pair's (chosen, rejected) log-probabilities under `model` as it is now, (len(data), 2), stored in
    data.reference too. dtype: the training's autocast dtype, so that the reference and the policy are rounded
    alike (None: float32)."""
    training = model.training
    model.to(device).eval()
    autocast = torch.autocast(torch.device(device).type, dtype=dtype) if dtype else nullcontext()
    found = []
    with autocast:
        for start in range(0, len(data), batch_size):
            inputs, labels = data.sides(range(start, min(start + batch_size, len(data))))
            found.append(sequence_logps(model, inputs.flatten(0, 1).to(device), labels.flatten(0, 1).to(device)))
    model.train(training)
    data.reference = torch.cat(found).view(-1, 2).cpu()
    return data.reference


def dpo_objective(model, data, val_data, batch_size: int, device: str = "cpu", dtype: torch.dtype | None = None,
                  settings: DPOSettings = DPOSettings()) -> DPOLoss:
    """DPO's setup: the reference log-probabilities of every pair of `data` and `val_data` (None: none) under
    `model` as it is now, the starting model, computed on this process's device (under torchrun, each process on
    its own GPU, as it will train there); then the objective that train() takes. dtype: the training's autocast
    dtype. Call it before train() loads a checkpoint to resume from: the reference is always the starting model."""
    for pairs in (data, val_data) if val_data is not None else (data,):
        reference_logps(model, pairs, batch_size, process_device(device), dtype)
    return DPOLoss(model, settings)

