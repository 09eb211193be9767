"""Models in which trainable parameters take no part (issue 28), written as people end up with them: a peft model
after ``merge_adapter()`` (the adapters keep requires_grad but no longer run), a layer created and never called, a
layer run under ``torch.no_grad()`` in the forward.

``refuse``: no trainable parameter takes part at all (every strategy refuses, naming them); otherwise those that take
no part get zeros, as the loop's ``allow_unused`` gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

DT = torch.float64


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x)))


class WithSpare(MLP):
    """A layer made for later (an auxiliary head) and not called yet."""

    def __init__(self):
        super().__init__()
        self.aux = nn.Linear(5, 2)


class FeaturesUnderNoGrad(MLP):
    """Features computed under no_grad (a frozen-backbone idiom), with the backbone left trainable."""

    def forward(self, x):
        with torch.no_grad():
            h = torch.tanh(self.fc(x))
        return self.head(h)


def _merged_lora(head_trainable: bool) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import peft

        torch.manual_seed(0)
        model = peft.get_peft_model(MLP().to(DT), peft.LoraConfig(r=2, target_modules=["fc"], lora_dropout=0.0))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                with torch.no_grad():
                    p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
        model.eval()
        model.merge_adapter()
        if head_trainable:
            model.base_model.model.head.weight.requires_grad_(True)
        return model

    return make


def _plain(cls: type[nn.Module], frozen: tuple[str, ...] = ()) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        model = cls().to(DT)
        for name, p in model.named_parameters():
            p.requires_grad_(not name.startswith(frozen))
        return model

    return make


@dataclass(frozen=True)
class UnusedCase:
    name: str
    make_model: Callable[[], nn.Module]
    refuse: bool
    needs: str = ""  # an optional package

    def __repr__(self) -> str:
        return f"UnusedCase({self.name})"


CASES = [
    UnusedCase("peft-merged", _merged_lora(False), refuse=True, needs="peft"),
    UnusedCase("peft-merged-head-trainable", _merged_lora(True), refuse=False, needs="peft"),
    UnusedCase("spare-layer", _plain(WithSpare), refuse=False),
    UnusedCase("only-the-spare-layer-trainable", _plain(WithSpare, frozen=("fc", "head")), refuse=True),
    UnusedCase("features-under-no-grad", _plain(FeaturesUnderNoGrad), refuse=False),
    UnusedCase("only-no-grad-layers-trainable", _plain(FeaturesUnderNoGrad, frozen=("head",)), refuse=True),
]
