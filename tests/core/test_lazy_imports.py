"""What PyTorch's lazy imports under a call would leave in the user's process, left out: sympy's warnings filter (its
first import, under the first batched backward: a Jacobian, the batched_grad strategy) and TORCHINDUCTOR_CACHE_DIR
(set by torch._dynamo's import under torch.func's first grad). Each in a fresh interpreter, where neither is imported
yet (this process has imported them long ago)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import os, sys, warnings
import torch
from torch import nn
import pergrad_viz as pv
assert "sympy" not in sys.modules and "torch._dynamo" not in sys.modules
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
filters, env = list(warnings.filters), dict(os.environ)
{call}
assert {module!r} in sys.modules, "the call did not import it: the test shows nothing"
added = [f for f in warnings.filters if f not in filters]
assert not added, f"filters left: {{added}}"
changed = {{k: v for k, v in os.environ.items() if env.get(k) != v}}
assert not changed, f"environment left: {{changed}}"
"""

CALLS = {
    "jacobian": ("pv.per_sample_jacobian(model, x)", "sympy"),
    "batched_grad": ("pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy='batched_grad')", "sympy"),
    "torch_func": ("pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy='torch_func')",
                   "torch._dynamo"),
}


@pytest.mark.parametrize("case", sorted(CALLS))
def test_a_first_call_leaves_no_filter_and_no_variable(case):
    call, module = CALLS[case]
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}  # as a user's process starts
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(call=call, module=module)], env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
