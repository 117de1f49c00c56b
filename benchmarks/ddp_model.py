"""The DDP step's model: the trainer's GPT, or a stand-in transformer without ``trainer``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)


@dataclass
class ModelSpec:
    """A model for the DDP step plus how to feed it."""

    name: str
    model: nn.Module
    vocab_size: int
    batch: int
    seq_len: int
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class _TinyTransformer(nn.Module):
    """Stand-in GPT-like model used when ``trainer.model`` is not importable."""

    def __init__(self, vocab: int = 256, dim: int = 128, layers: int = 2, seq: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq, dim))
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab)."""
        t = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        h = self.blocks(self.tok(idx) + self.pos[:, :t], mask=mask, is_causal=True)
        return self.head(h)  # type: ignore[no-any-return]


def _logits_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a model whose forward returns logits."""
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _gpt_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Loss of ``trainer.model.GPT``, whose ``forward(idx, targets)`` returns ``(logits, loss)``."""
    _, loss = model(x, y)
    return loss  # type: ignore[no-any-return]


DDP_BATCH = 8  # sequences per rank per step


def _make_trainer_model() -> ModelSpec:
    """The trainer's GPT with its default ``GPTConfig`` (raises if ``trainer.model`` is absent)."""
    from trainer.model import GPT, GPTConfig

    cfg = GPTConfig()
    name = (
        f"trainer.model.GPT (n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, "
        f"block_size={cfg.block_size})"
    )
    return ModelSpec(name, GPT(cfg), cfg.vocab_size, DDP_BATCH, cfg.block_size, _gpt_loss)


def make_model() -> ModelSpec:
    """The trainer's GPT when importable, else the tiny stand-in transformer."""
    try:
        return _make_trainer_model()
    except ImportError as e:
        log.debug("trainer.model not importable (%r); using the stand-in transformer", e)
    return ModelSpec(
        "stand-in transformer (2 x 128)", _TinyTransformer(), 256, DDP_BATCH, 64, _logits_loss
    )
