"""Text embeddings: the mean of the model's final normed hidden states over a text's tokens, L2-normalized, as
llama.cpp's `--pooling mean` computes them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .request import checked_rows


def embed(model, rows) -> torch.Tensor:
    """Each row of token ids -> its embedding, (B, hidden_size) float32, of unit length.

    rows: token ids, as generate() takes them (a list of ids, a list of lists, a tensor). The rows run as one
    batch, padded at their ends: under the causal mask a row's tokens never see the padding after them, and each
    row's mean counts its own tokens alone, so a row's embedding is the one it gets alone (up to float rounding)."""
    rows = checked_rows(rows, model.config)
    longest = max(map(len, rows))
    device = model.model.embed_tokens.weight.device
    ids = torch.zeros(len(rows), longest, dtype=torch.long, device=device)
    mine = torch.zeros(len(rows), longest, 1, device=device)  # 1 at each row's own tokens, 0 at its padding
    for b, row in enumerate(rows):
        ids[b, :len(row)] = torch.tensor(row)
        mine[b, :len(row)] = 1
    with torch.inference_mode():
        h = model.hidden_states(ids).float()  # (B, T, C), after the final RMSNorm
        mean = (h * mine).sum(1) / mine.sum(1)
        return F.normalize(mean, dim=-1)
