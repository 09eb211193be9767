"""The package's dispatch modes leave torch._dynamo unimported: PyTorch wraps a mode's ``__torch_dispatch__`` in
``torch._disable_dynamo``, whose first call imports it, and imported after ``init_process_group`` it keeps gloo's
threads alive past ``destroy_process_group`` (the process then aborted at exit in about one torchrun run in three)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys, torch
from torch import nn
import pergrad_viz as pv
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.1), nn.Tanh(), nn.Linear(6, 3))
x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
loss_fn = nn.CrossEntropyLoss()
pv.per_sample_grads(model.eval(), loss_fn, x, y)  # the probe, the check: the random-ops mode runs
pv.per_sample_grads(model.train(), loss_fn, x, y, randomness="different")  # draws held fixed for the probe
pv.clipped_grad_sum(model, loss_fn, x, y, 1.0, randomness="different")
pv.per_sample_grads(model, loss_fn, x, y, strategy="loop", randomness="different")
print("dynamo" if "torch._dynamo" in sys.modules else "clean")
"""


def test_calls_do_not_import_torch_dynamo():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "clean", proc.stdout
