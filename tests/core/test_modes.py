"""core/validate.check_modes, read on every call before the model runs: the refusals by module type (read once per
type) and Hugging Face's reentrant checkpointing flag, an instance or a class attribute, in training mode only."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pergrad_viz as pv
from pergrad_viz.core.validate import check_modes


class _Checkpointed(nn.Module):
    """A module as Hugging Face's encoders are after ``gradient_checkpointing_enable``."""

    def __init__(self, reentrant: bool, flag_on_class: bool = False):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        if not flag_on_class:
            self.gradient_checkpointing = True
        self._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint,
                                                              use_reentrant=reentrant)

    def forward(self, x):
        raise AssertionError("check_modes must refuse before the model runs")


class _ClassFlag(_Checkpointed):
    gradient_checkpointing = True


@pytest.mark.parametrize("make", [lambda: _Checkpointed(True), lambda: _ClassFlag(True, flag_on_class=True)])
def test_reentrant_checkpointing_refused_before_the_model_runs(make):
    model = make()
    with pytest.raises(pv.UnsupportedModelError, match="use_reentrant=False"):
        check_modes(model)
    model.eval()  # the flag counts in training mode only
    check_modes(model)


def test_non_reentrant_checkpointing_and_a_false_flag_pass():
    check_modes(_Checkpointed(False))
    model = _Checkpointed(True)
    model.gradient_checkpointing = False
    check_modes(model)


class _MyDropout(nn.Dropout):
    pass


def test_a_subclass_of_a_refused_type_is_refused_and_a_flag_change_is_seen():
    model = nn.Sequential(nn.Linear(3, 3), _MyDropout(0.5), nn.Linear(3, 2))
    with pytest.raises(pv.UndefinedPerSampleError, match=r"1 \(_MyDropout\) is in training mode"):
        check_modes(model)
    check_modes(model, "different")
    model.eval()
    check_modes(model)  # the same module types, another mode: read afresh
    model[1].train()
    with pytest.raises(pv.UndefinedPerSampleError, match="training mode"):
        check_modes(model)
