"""On a CUDA device (skipped without one): the zoo's architectures, per-sample gradients, their norms and the DP
clipped sum against a loop written here on the same device, in float64; float32 models with and without TF32
convolutions (cuDNN's default on Ampere and later) against float64 and a float32 loop, with the fast path kept (no
refusal, no spurious hand-over from the per-call check); the model left as it was."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torchvision
from helpers import assert_state_unchanged, in_batch_grads, ref_grads, snapshot
from torch import nn
from torch.utils._pytree import tree_map
from zoo.cases import CASES

import pergrad_viz as pv
from pergrad_viz.tutorial.networks import MLP, SmallCNN

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
ZOO = [c for c in CASES if c.expects(0) != "refuse"]


def on_cuda(obj):
    return tree_map(lambda t: t.cuda() if isinstance(t, torch.Tensor) else t, obj)


def clipped_loop(grads: dict[str, torch.Tensor], bound: float) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """sum_i min(1, C / (||g_i|| + 1e-6)) g_i of per-sample gradients {name: (B, *shape)}, and the (B,) norms."""
    batch = next(iter(grads.values())).shape[0]
    norms = torch.tensor([math.sqrt(sum(float(g[i].square().sum()) for g in grads.values())) for i in range(batch)],
                         dtype=torch.float64)
    factors = [min(1.0, bound / (float(n) + 1e-6)) for n in norms]
    return {name: sum(f * g[i] for i, f in enumerate(factors)) for name, g in grads.items()}, norms


@pytest.mark.parametrize("case", ZOO, ids=lambda c: c.name)
def test_zoo_on_cuda_equals_the_loop(case):
    model = case.prepare(case.make_model(), 0).cuda()
    x, y = on_cuda(case.make_inputs(case.batches[0]))
    loss_fn = next(iter(case.loss_fns.values()))()
    want = ref_grads(model, loss_fn, x, y)
    before = snapshot(model)
    strategies = ("auto", "hooks") if case.expects(0) == "hooks" else ("auto",)
    for strategy in strategies:
        got = pv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)
        assert list(got) == list(want)
        for name, w in want.items():
            assert got[name].device.type == "cuda", name
            torch.testing.assert_close(got[name], w, rtol=1e-6, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}")
    bound = float(clipped_loop(want, 1e30)[1].median())  # about half of the samples clipped
    want_sum, want_norms = clipped_loop(want, bound)
    got_sum, got_norms = pv.clipped_grad_sum(model, loss_fn, x, y, bound, return_norms=True,
                                             strategy=strategies[-1])
    scale = max(float(w.abs().max()) for w in want_sum.values())
    for name, w in want_sum.items():
        torch.testing.assert_close(got_sum[name], w, rtol=1e-6, atol=1e-9 * scale, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(got_norms.cpu(), want_norms, rtol=1e-9, atol=1e-12)
    norms = pv.per_sample_grad_norms(model, loss_fn, x, y, strategy=strategies[-1])
    torch.testing.assert_close(norms.cpu(), want_norms, rtol=1e-9, atol=1e-12)
    assert_state_unchanged(model, before)


def _float32(name: str):
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    if name == "mlp":
        return MLP(784, 20, 10).cuda(), torch.randn(32, 784, generator=g).cuda()
    if name == "resnet18":  # eval mode: batch norm's running statistics, no interaction
        return torchvision.models.resnet18(num_classes=10).eval().cuda(), torch.randn(32, 3, 32, 32, generator=g).cuda()
    return SmallCNN().cuda(), torch.randn(32, 1, 28, 28, generator=g).cuda()


def assert_as_close_as_the_loop(got: dict, references: list[dict], exact: dict, rounding: float) -> None:
    """Per sample and parameter, ``got`` is at most 8 times as far from the float64 ``exact`` as the float32
    references are (the per-call check's criterion: the loop, and each sample's value from a forward of the whole
    batch, whose kernels differ from a sample's alone), plus ``rounding`` times the row's size."""
    for name, e in exact.items():
        off = (got[name].double() - e).flatten(1).norm(dim=1)  # (B,): also for a 0-dim parameter's rows
        ref_off = torch.stack([(r[name].double() - e).flatten(1).norm(dim=1) for r in references]).amax(0)
        size = e.flatten(1).norm(dim=1)
        bad = off > 8 * ref_off + rounding * size
        assert not bad.any(), (f"{name}: {off[bad].tolist()[:3]} from float64, the references "
                               f"{ref_off[bad].tolist()[:3]}, the rows' size {size[bad].tolist()[:3]}")


@pytest.mark.parametrize("tf32", [False, True], ids=["float32", "tf32-convolutions"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet18"])
def test_float32_on_cuda_keeps_the_fast_path(tf32_settings, name, tf32):
    """Neither the probe nor the per-call check may refuse float32 on the device, with cuDNN's TF32 convolutions
    (PyTorch's default) or without; the rows are as close to float64's as the float32 references are (the loop, and
    each sample from a forward of the whole batch: its kernels, TF32 for 32 samples, differ from one's), plus float32's
    rounding (TF32's, 10 bits, the per-call check's tolerance for it, where the convolutions round to it)."""
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32, False
    model, x = _float32(name)
    y = torch.arange(32, device="cuda") % 10
    loss_fn = nn.CrossEntropyLoss()
    references = [ref_grads(model, loss_fn, x, y), in_batch_grads(model, x, y)]
    exact = ref_grads(copy.deepcopy(model).double(), loss_fn, x.double(), y)
    rounding = 5e-2 if tf32 else 1e-5
    for _ in range(3):  # the checked first calls
        got = pv.per_sample_grads(model, loss_fn, x, y, strategy="hooks")
    assert_as_close_as_the_loop(got, references, exact, rounding)
    sums = pv.clipped_grad_sum(model, loss_fn, x, y, 0.5, strategy="hooks")

    def summed(rows: dict) -> dict:
        return {n: t.unsqueeze(0) for n, t in clipped_loop(rows, 0.5)[0].items()}

    assert_as_close_as_the_loop({n: t.unsqueeze(0) for n, t in sums.items()}, [summed(r) for r in references],
                                summed(exact), rounding)
