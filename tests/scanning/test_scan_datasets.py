"""Scans over the datasets people have (issue 28, tests/zoo/datasets.py): dict items with Hugging Face models, their
``ModelOutput``s (``output=``), the package's sequence losses, keyword inputs, against a loop over the items written
here; the caller's RNG is not drawn from; under inference_mode, a torch.nn loss on a ModelOutput without ``output=``:
clear errors."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_no_hooks,
    assert_process_unchanged,
    assert_refuses,
    assert_state_unchanged,
    process_state,
    snapshot,
)
from zoo.datasets import CASES, TokenDicts

import pergrad_viz as pv
from pergrad_viz.scanning.sketch import GradientSketch

pytest.importorskip("transformers")
K = 24


def _reference(case):
    """Per item: loss, gradient (flat, P) and logits, by a loop of one item at a time."""
    model, data = case.make_model(), case.dataset()
    params = [p for p in model.parameters() if p.requires_grad]
    losses, grads, logits = [], [], []
    for i in range(len(data)):
        item = {k: v.unsqueeze(0) for k, v in data[i].items()}
        labels = item.pop("labels")
        item = {k: v.double() if v.is_floating_point() else v for k, v in item.items()}
        out = model(**item)
        picked = case.output(out) if case.output is not None else out
        loss = case.loss_fn(picked, labels)
        g = torch.autograd.grad(loss, params, allow_unused=True)
        grads.append(torch.cat([torch.zeros(p.numel(), dtype=p.dtype) if t is None else t.reshape(-1)
                                for t, p in zip(g, params, strict=True)]))
        losses.append(loss.detach())
        logits.append((out if isinstance(out, torch.Tensor) else out.logits).detach()[0])
    return model, torch.stack(losses), torch.stack(grads), logits


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_scan_of_dataset_equals_the_loop(case, tmp_path):
    model, losses, grads, logits = _reference(case)
    quantities = ["loss", "grad_norm", *(["el2n"] if case.el2n else [])]
    before, process = snapshot(model), process_state()
    got = pv.scan(model, case.loss_fn, case.dataset(), quantities=quantities, batch_size=4, chunk_size=4,
                  proj_dim=K, out=tmp_path / "scan", progress=False, output=case.output)
    assert_no_hooks(model)
    assert_state_unchanged(model, before)
    assert_process_unchanged(process)
    torch.testing.assert_close(torch.as_tensor(got["loss"]), losses, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(torch.as_tensor(got["grad_norm"]), grads.norm(dim=1), rtol=1e-6, atol=1e-9)
    if case.el2n:
        want = torch.stack([(torch.softmax(z, 0) - torch.nn.functional.one_hot(torch.tensor(i % 3), 3)).norm()
                            for i, z in enumerate(logits)])
        torch.testing.assert_close(torch.as_tensor(got["el2n"]), want, rtol=1e-7, atol=1e-10)
    sketch = GradientSketch(model, K, 0)
    torch.testing.assert_close(torch.as_tensor(got["projection"]), sketch.project_grads(grads),
                               rtol=1e-6, atol=1e-9)


def test_a_torch_loss_on_a_model_output_names_output(tmp_path):
    case = CASES[0]
    model = case.make_model()
    assert_refuses(lambda: pv.scan(model, case.loss_fn, case.dataset(), quantities=["loss", "grad_norm"],
                                   batch_size=2, out=tmp_path / "s", progress=False),
                   model, "output=lambda out: out.logits", error=TypeError)


def test_scan_under_inference_mode_is_refused(tmp_path):
    case = CASES[1]
    model = case.make_model()
    with torch.inference_mode():
        assert_refuses(lambda: pv.scan(model, case.loss_fn, TokenDicts(causal=False), batch_size=2,
                                       out=tmp_path / "s", progress=False),
                       model, "outside the inference_mode block", error=RuntimeError)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("num_workers", [0, 1])
def test_scan_does_not_draw_from_the_global_rng(tmp_path, num_workers):
    case = CASES[-1]
    model = case.make_model()
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    pv.scan(model, case.loss_fn, case.dataset(), quantities=["loss", "grad_norm"], batch_size=2,
            out=tmp_path / "s", progress=False, num_workers=num_workers)
    assert torch.equal(torch.get_rng_state(), rng), "the scan drew from the caller's global RNG"


class _Lengths(torch.utils.data.Dataset):
    """Examples of 3, 4 and 5 features: they cannot be stacked into one batch."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return torch.randn(3 + i % 3), torch.tensor(i % 2)


class _MeanLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(1, 2)

    def forward(self, x):
        return self.lin(x.mean(1, keepdim=True))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_examples_of_different_lengths_name_padding_or_batches_of_one(tmp_path, num_workers):
    """Found by a probe: torch's raw collate error ("stack expects each tensor to be equal size"), no word of the
    fix; the same examples one at a time scan fine."""
    model, loss = _MeanLinear(), torch.nn.CrossEntropyLoss()
    with pytest.raises(RuntimeError, match="equal size") as info:
        pv.scan(model, loss, _Lengths(), batch_size=3, out=tmp_path / "a", progress=False, num_workers=num_workers)
    assert "pad every example to one length" in " ".join(getattr(info.value, "__notes__", ()))
    scan = pv.scan(model, loss, _Lengths(), batch_size=1, out=tmp_path / "b", progress=False)
    assert scan["loss"].shape == (6,)
