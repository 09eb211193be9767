"""Datasets as people have them, for scans (issue 28): dict items (``input_ids``, ``attention_mask``, ``labels``) fed
to Hugging Face models built tiny from configs (they return ``ModelOutput``s), with a ``torch.nn`` loss and
``output=``, or the package's sequence losses; and a plain module taking keyword inputs.

Each :class:`ScanCase`: ``make_model()`` (float64, eval), ``dataset`` (N items, seeded), ``loss_fn``, the ``output=``
selector (or None), and whether EL2N applies (a classifier's (B, C) logits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pergrad_viz.core.losses import causal_lm_loss, sequence_classification_loss

VOCAB, T, N = 40, 7, 6


class TokenDicts(torch.utils.data.Dataset):
    """N items ``{input_ids (T,), attention_mask (T,), labels}``: odd items padded after 4 tokens; ``labels`` a class
    (``causal=False``) or the ids with -100 at the padding (``causal=True``)."""

    def __init__(self, causal: bool, classes: int = 3):
        self.causal, self.classes = causal, classes

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(100 + i)
        ids = torch.randint(1, VOCAB, (T,), generator=g)
        mask = torch.ones(T, dtype=torch.long)
        if i % 2:
            mask[4:] = 0
            ids[4:] = 0
        labels = ids.masked_fill(mask == 0, -100) if self.causal else torch.tensor(i % self.classes)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class Scaled(nn.Module):
    """A module with keyword inputs: ``model(x=..., scale=...)``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x, scale):
        return self.head(torch.tanh(self.fc(x) * scale.unsqueeze(-1)))


class KeywordItems(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(200 + i)
        return {"x": torch.randn(5, generator=g), "scale": torch.rand((), generator=g) + 0.5,
                "labels": torch.tensor(i % 3)}


def _bert() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=24, max_position_embeddings=16, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config).double().eval()


def _gpt2() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).double().eval()


def _scaled() -> nn.Module:
    torch.manual_seed(0)
    return Scaled().double().eval()


@dataclass(frozen=True)
class ScanCase:
    name: str
    make_model: Callable[[], nn.Module]
    dataset: Callable[[], torch.utils.data.Dataset]
    loss_fn: Callable
    output: Callable | None
    el2n: bool

    def __repr__(self) -> str:
        return f"ScanCase({self.name})"


def _logits(out):
    return out.logits


CASES = [
    ScanCase("bert-dicts-ce-output", _bert, lambda: TokenDicts(causal=False), nn.CrossEntropyLoss(), _logits, True),
    ScanCase("bert-dicts-sequence-loss", _bert, lambda: TokenDicts(causal=False), sequence_classification_loss,
             None, True),
    ScanCase("gpt2-dicts-causal-loss", _gpt2, lambda: TokenDicts(causal=True), causal_lm_loss, None, False),
    ScanCase("keyword-items", _scaled, KeywordItems, nn.CrossEntropyLoss(reduction="sum"), None, True),
]
