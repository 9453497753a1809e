"""Helpers of the export tests."""

from __future__ import annotations

import numpy as np


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    """fp32 logits [B,T,V] of a transformers causal LM on int ids [B,T]."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
