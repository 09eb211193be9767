"""Gradient checkpointing as people turn it on (issue 28): ``torch.utils.checkpoint.checkpoint`` in a custom forward,
and a Hugging Face model's ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ...})``
(which checkpoints in training mode only), each with ``use_reentrant=True`` (refused by every strategy, naming
``use_reentrant=False``) and ``use_reentrant=False`` (the loop's numbers).

Each maker returns a model taking one float64 tensor (B, 4) or (B, T) token ids, and giving (B, 3) logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

DT = torch.float64


class CheckpointedBlock(nn.Module):
    """stem -> checkpointed (fc, tanh, fc2) -> head, as a memory-saving custom forward writes it."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.stem = nn.Linear(4, 6)
        self.fc = nn.Linear(6, 6)
        self.fc2 = nn.Linear(6, 5)
        self.head = nn.Linear(5, 3)
        self.reentrant = reentrant

    def block(self, h):
        return self.fc2(torch.tanh(self.fc(h)))

    def forward(self, x):
        h = checkpoint(self.block, torch.relu(self.stem(x)), use_reentrant=self.reentrant)
        return self.head(h)


class CheckpointedFirst(CheckpointedBlock):
    """The checkpointed block first, on an input that requires grad (as peft's ``enable_input_require_grads`` makes
    a frozen embedding's output): no trainable layer comes before the checkpoint, so PyTorch raises nothing, and
    ``autograd.grad`` leaves the block's layers without gradients that ``.backward()`` gives them."""

    def forward(self, x):
        return self.head(torch.relu(self.stem(checkpoint(self.block6, x, use_reentrant=self.reentrant))))

    def block6(self, x):
        return torch.tanh(self.fc(torch.cat([x, x[:, :2]], 1)))  # (B, 4) -> (B, 6)


class AllCheckpointed(nn.Module):
    """Every trainable layer inside one reentrant checkpoint, on inputs that require no grad: the loss then requires
    no grad at all (a probe: the baselines said "no trainable parameter takes part", naming merged adapters)."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.fc, self.head = nn.Linear(4, 6), nn.Linear(6, 3)
        self.reentrant = reentrant

    def forward(self, x):
        return checkpoint(lambda h: self.head(torch.tanh(self.fc(h))), x, use_reentrant=self.reentrant)


def every(reentrant: bool) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return AllCheckpointed(reentrant).to(DT)

    return make


def first(reentrant: bool) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        model = CheckpointedFirst(reentrant).to(DT)
        model.stem, model.fc2 = nn.Linear(6, 5).to(DT), None  # fc (6 -> 6) in the checkpoint, then stem, head
        return model

    return make


def custom(reentrant: bool) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return CheckpointedBlock(reentrant).to(DT)

    return make


def hf_bert(reentrant: bool) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import transformers

        from pergrad_viz.tutorial.hf_models import Logits

        torch.manual_seed(0)
        config = transformers.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=24, max_position_embeddings=16, num_labels=3,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.BertForSequenceClassification(config).to(DT)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return Logits(model.train(), "input_ids")  # checkpointing runs in training mode only (dropout is 0)

    return make


def floats(batch: int) -> torch.Tensor:
    return torch.randn(batch, 4, generator=torch.Generator().manual_seed(11), dtype=DT)


def floats_requiring_grad(batch: int) -> torch.Tensor:
    return floats(batch).requires_grad_()


def tokens(batch: int) -> torch.Tensor:
    return torch.randint(1, 30, (batch, 6), generator=torch.Generator().manual_seed(12))


CASES = [  # (name, maker, inputs, reentrant, optional package)
    ("custom-reentrant", custom(True), floats, True, ""),
    ("custom-non-reentrant", custom(False), floats, False, ""),
    ("first-reentrant", first(True), floats_requiring_grad, True, ""),
    ("all-reentrant", every(True), floats, True, ""),
    ("all-non-reentrant", every(False), floats, False, ""),
    ("first-non-reentrant", first(False), floats_requiring_grad, False, ""),
    ("hf-bert-reentrant", hf_bert(True), tokens, True, "transformers"),
    ("hf-bert-non-reentrant", hf_bert(False), tokens, False, "transformers"),
]
