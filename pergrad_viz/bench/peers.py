"""Other libraries' per-sample gradients, as benchmark peers: Opacus and BackPACK.

Both are optional: ``pergrad_viz`` imports and works without them. Each peer works on its own deep
copy of the model (they add hooks and attributes), with MSE or cross-entropy loss of ``reduction='sum'``
so that their per-sample gradients are the plain gradients of each sample's loss.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import torch
from torch import nn

from pergrad_viz.core.extras import available as importable
from pergrad_viz.core.extras import missing_extra

PEERS: tuple[str, ...] = ("opacus", "backpack")
_MODULE = {"opacus": "opacus", "backpack": "backpack"}


def available(name: str) -> bool:
    """Whether the peer's package is installed."""
    return importable(_MODULE[name])


def _opacus(model: nn.Module, loss_fn: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
            ) -> Callable[[], dict[str, torch.Tensor]]:
    from opacus import GradSampleModule

    gsm = GradSampleModule(copy.deepcopy(model), batch_first=True, loss_reduction="sum", strict=False)
    gsm.train(model.training)
    params = [(n.removeprefix("_module."), p) for n, p in gsm.named_parameters() if p.requires_grad]

    def run() -> dict[str, torch.Tensor]:
        for _, p in params:
            p.grad = None
            p.grad_sample = None
        with warnings.catch_warnings():  # "Full backward hook is firing when gradients are computed with respect
            warnings.simplefilter("ignore")  # to module outputs since no inputs require gradients": expected here
            loss_fn(gsm(inputs), targets).backward()
        return {n: p.grad_sample for n, p in params}

    return run


def _backpack(model: nn.Module, loss_fn: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
              ) -> Callable[[], dict[str, torch.Tensor]]:
    from backpack import backpack, extend
    from backpack.extensions import BatchGrad

    net = extend(copy.deepcopy(model))
    loss = extend(copy.deepcopy(loss_fn))
    params = [(n, p) for n, p in net.named_parameters() if p.requires_grad]

    def run() -> dict[str, torch.Tensor]:
        for _, p in params:
            p.grad = None
        with backpack(BatchGrad()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # as for Opacus, and "no extension for Module MLP" (it has none itself)
            loss(net(inputs), targets).backward()
        return {n: p.grad_batch for n, p in params}

    return run


def make_peer(name: str, model: nn.Module, loss_fn: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
              ) -> Callable[[], dict[str, torch.Tensor]]:
    """A no-argument function computing ``{name: (B, *param.shape)}`` with the peer library.

    Raises ValueError for an unknown peer name, MissingExtraError (an ImportError naming the extra ``peers``)
    when not installed.
    """
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; valid names: {', '.join(PEERS)}")
    if not available(name):
        raise missing_extra(_MODULE[name], f"the peer {name!r}")
    return {"opacus": _opacus, "backpack": _backpack}[name](model, loss_fn, inputs, targets)
