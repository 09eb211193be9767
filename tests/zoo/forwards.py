"""Zoo cases for forwards written the way people write them, one group per root cause of a silent wrong answer
(issue 16). Each is a :class:`zoo.cases.Case`; ``tests/strategies/test_zoo.py`` runs them like the others (every
strategy equals the loop or refuses, ``auto`` always equals the loop, grads, Jacobians, norms and the NTK, the model
left as it was).

``before_call(model, k)`` puts the model in the state of call k (on the tested model and on the reference's alike):
a head switched by a plain attribute, a flag turned on, an optimiser step that switches a branch.
"""

from __future__ import annotations

import torch
from torch import nn
from zoo.cases import DT, Case, build, floats, image_inputs, labels, seeded, token_inputs


class _FcHead(nn.Module):
    """``fc`` (4 -> 5) and ``head`` (5 -> 3): what the subclasses' forwards do between them is the point."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.head = nn.Linear(5, 3)


# --------------------------------------------------------------------- 1. outputs that depend on each other


class LSTMCellNet(nn.Module):
    """An nn.LSTMCell looped over time: it returns (h, c) with h = o * tanh(c), and both feed the next step."""

    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(3, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):  # (B, T, 3)
        h = c = torch.zeros(x.shape[0], 4, dtype=x.dtype)
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
        return self.head(h)


class LSTMCellOnce(nn.Module):
    """One LSTMCell step from a given state, whose new cell state c is never used downstream: only the path
    through h counts. Input (B, 9): 4 features, then the 5 of the state (h0 = them, c0 = half of them)."""

    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(4, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        state = x[:, 4:]
        h, _c = self.cell(x[:, :4], (state, 0.5 * state))
        return self.head(h)


class TwoOutputs(nn.Module):
    """A layer of its own (no rule) returning (z, tanh(z)): the second output is computed from the first."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1, 1, 20).reshape(4, 5))

    def forward(self, x):
        z = x @ self.weight
        return z, torch.tanh(z)


class TwoOutputsNet(nn.Module):
    def __init__(self, use_both: bool):
        super().__init__()
        self.layer = TwoOutputs()
        self.head = nn.Linear(5, 3)
        self.use_both = use_both

    def forward(self, x):
        z, t = self.layer(x)
        return self.head(t + 0.3 * z if self.use_both else t)


class SequenceAndLast(nn.Module):
    """An encoder returning (seq, seq[:, -1]), as many do: the second output is a view of the first."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-0.8, 0.9, 12).reshape(3, 4))

    def forward(self, x):
        seq = torch.tanh(x @ self.weight)
        return seq, seq[:, -1]


class SequenceAndLastNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = SequenceAndLast()
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        seq, last = self.encoder(x)
        return self.head(seq.mean(1) + last)


# --------------------------------------------------------------------- 2. rows reordered inside forward


class SortByKey(_FcHead):
    """Sorts the batch by a key of the data, runs a layer, then unsorts (as before packing sequences)."""

    def forward(self, x):
        order = x.sum(1).argsort()
        h = torch.tanh(self.fc(x[order]))
        return self.head(h[order.argsort()])


class SortByLengthLSTM(nn.Module):
    """Token sequences sorted by length (count of non-zero tokens), an LSTM on the sorted batch, unsorted after."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, 4)
        self.lstm = nn.LSTM(4, 5, batch_first=True)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        order = (x != 0).sum(1).argsort(descending=True, stable=True)
        out, _ = self.lstm(self.emb(x[order]))
        return self.head(out[:, -1][order.argsort()])


def _lengths_inputs(name: str, t: int, vocab: int):
    def make(batch: int):
        x, y = token_inputs(name, t, vocab)(batch)
        x = x.clamp(min=1)
        for i in range(batch):  # sample i has t - i % t tokens: the sort reverses the batch
            x[i, t - i % t:] = 0
        return x, y

    return make


class SwapRowsOneTwo(_FcHead):
    """Swaps rows 1 and 2 of a batch of 3 or more before a layer and back after: a pair never shows it."""

    def forward(self, x):
        idx = torch.arange(x.shape[0])
        if x.shape[0] >= 3:
            idx[1], idx[2] = 2, 1
        return self.head(torch.tanh(self.fc(x[idx]))[idx])


# --------------------------------------------------------------------- 3. couplings a pair does not show


class BranchOnBatchSize(_FcHead):
    """Code that depends on x.shape[0]: a pair of samples and one alone both take the same path, three do not."""

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        return self.head(h * 2 if x.shape[0] > 2 else h)


class ShiftWhenLarge(_FcHead):
    """A batch statistic that only matters for some inputs: ``torch.where`` on the batch's total activity shifts
    every row by the batch's column sums once that total passes a threshold (samples 0 and 1, the probe's pair,
    stay below it)."""

    def forward(self, x):
        h = self.fc(x)
        h = torch.where(h.abs().sum() > 40.0, h - 0.05 * h.sum(0, keepdim=True), h)
        return self.head(torch.tanh(h))


def _one_large_sample(name: str):
    def make(batch: int):
        x, y = image_inputs(name, (4,))(batch)
        x = x.clamp(-1, 1)
        x[2:] *= 30.0
        return x, y

    return make


class _MixInBackward(torch.autograd.Function):
    """The identity forward; a backward that adds the batch mean of the gradients to every row."""

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g + g.mean(0, keepdim=True)


class CoupledInBackward(_FcHead):
    def forward(self, x):
        return self.head(_MixInBackward.apply(torch.tanh(self.fc(x))))


class Centring(_FcHead):
    """Subtracts the batch mean when ``self.center`` is on (a plain attribute a plan made before cannot see)."""

    def __init__(self, center: bool):
        super().__init__()
        self.center = center

    def forward(self, x):
        h = self.fc(x)
        centred = h - h.mean(0, keepdim=True) if self.center else h
        return self.head(torch.tanh(h) + 0.5 * centred)


def _identical_inputs(name: str):
    def make(batch: int):
        x, _ = image_inputs(name, (4,))(batch)
        g = seeded(name + "-targets", batch)
        return x[:1].expand(batch, 4), labels(batch, g)

    return make


class SmallCouplingBesideLargeFeature(nn.Module):
    """Outputs (B, 4) whose last column is 1e6 (its target too): a coupling of 1e-4 in the other columns hides
    under a tolerance scaled by the tensor's largest value."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        h = h + 1e-4 * h.mean(0, keepdim=True)
        return torch.cat([h, torch.full_like(h[:, :1], 1e6)], dim=1)


def _large_target_inputs(name: str):
    def make(batch: int):
        g = seeded(name, batch)
        y = floats(batch, 4, gen=g)
        y[:, 3] = 1e6
        return floats(batch, 4, gen=g), y

    return make


# --------------------------------------------------------------------- 4. a plan that no longer describes the model


class MultiTask(nn.Module):
    """One body, one head per task; ``self.task`` (a plain int) picks the head."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 5)
        self.heads = nn.ModuleList([nn.Linear(5, 3), nn.Linear(5, 3)])
        self.task = 0

    def forward(self, x):
        return self.heads[self.task](torch.tanh(self.body(x)))


class BranchOnParameter(nn.Module):
    """Takes an extra layer when fc's bias sums above zero: an optimiser step can switch it on. (The bias is then
    used outside fc's forward, which the probe sees: ``auto`` computes each sample alone.)"""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.extra = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)
        with torch.no_grad():
            self.fc.bias.copy_(torch.linspace(-1.0, -0.2, 5))

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        if self.fc.bias.sum() > 0:
            h = torch.tanh(self.extra(h))
        return self.head(h)


class BranchOnBuffer(nn.Module):
    """Takes an extra layer once a buffer (a step counter an optimiser loop updates) passes zero: a plan made
    before never saw that layer, whose gradients would be exactly zero."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.extra = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)
        self.register_buffer("step", torch.tensor(0.0, dtype=DT))

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        if self.step > 0:
            h = torch.tanh(self.extra(h))
        return self.head(h)


def _set_task(model, k):
    model.task = k % 2


def _set_center(model, k):
    model.center = k % 2 == 1


@torch.no_grad()
def _optimizer_step(model, k):
    """Call k > 0 comes after an SGD step that moved fc's bias above zero (absolute: the same state for call k)."""
    model.fc.bias.copy_(torch.linspace(-1.0, -0.2, 5) + (1.5 if k % 2 else 0.0))


@torch.no_grad()
def _count_step(model, k):
    model.step.fill_(float(k % 2))


CASES: list[Case] = [
    Case("lstmcell-loop-over-time", build(LSTMCellNet), image_inputs("lstmcell", (3, 3))),
    Case("lstmcell-c-unused", build(LSTMCellOnce), image_inputs("lstmcell-c-unused", (9,))),
    Case("two-outputs-z-and-tanh-z", build(lambda: TwoOutputsNet(True)), image_inputs("two-outputs", (4,))),
    Case("two-outputs-first-unused", build(lambda: TwoOutputsNet(False)), image_inputs("two-outputs-1", (4,))),
    Case("encoder-seq-and-last", build(SequenceAndLastNet), image_inputs("seq-and-last", (5, 3))),
    Case("sort-by-key-and-unsort", build(SortByKey), image_inputs("sort-by-key", (4,)), expect="torch_func"),
    Case("sort-by-length-lstm", build(SortByLengthLSTM), _lengths_inputs("sort-by-length", 5, 9),
         expect="torch_func"),
    Case("branch-on-batch-size", build(BranchOnBatchSize), image_inputs("branch-on-b", (4,)),
         expect="hooks"),
    Case("batch-max-shift-when-large", build(ShiftWhenLarge), _one_large_sample("batch-max"),
         expect="hooks"),
    Case("coupled-in-custom-backward", build(CoupledInBackward), image_inputs("coupled-backward", (4,)),
         expect="hooks", jacobian=False),
    Case("centring-identical-inputs", build(lambda: Centring(True)), _identical_inputs("identical-inputs"),
         expect="hooks"),
    Case("small-coupling-beside-large-feature", build(SmallCouplingBesideLargeFeature),
         _large_target_inputs("small-coupling"), loss_fns={"mse-sum": lambda: nn.MSELoss(reduction="sum")},
         expect="torch_func", jacobian=False),
    Case("multi-task-head-switched", build(MultiTask), image_inputs("multi-task", (4,)), batches=(3, 3),
         before_call=_set_task),
    Case("centring-flag-turned-on", build(lambda: Centring(False)), image_inputs("centring-flag", (4,)),
         batches=(3, 3), before_call=_set_center, expect=("hooks", "torch_func")),
    Case("optimizer-step-switches-branch", build(BranchOnParameter), image_inputs("branch-on-param", (4,)),
         batches=(3, 3), before_call=_optimizer_step, expect="torch_func"),
    Case("buffer-switches-branch", build(BranchOnBuffer), image_inputs("branch-on-buffer", (4,)),
         batches=(3, 3), before_call=_count_step),
]

# A reordering a pair never shows: only the per-call check sees it, with probability 2/3 per call at B=3
# (tests/engine/test_certify.py).
SWAP_ROWS = Case("swap-rows-1-2", build(SwapRowsOneTwo), image_inputs("swap-rows", (4,)))
assert DT is torch.float64
