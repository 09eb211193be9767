"""What PyTorch's lazy imports under a call would leave in the user's process, left out (core/process.py): sympy's
warnings filter (its first import, under torch._dynamo's, which torch.func's first grad or a first batched backward
brings: a Jacobian, batched_grad, a layer taking the per-layer fallback, a scan of one) and TORCHINDUCTOR_CACHE_DIR
(set by torch._dynamo's import, made absolute). Each in a fresh interpreter, where neither is imported yet (this
process imported them long ago)."""

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

class Scale(nn.Module):  # no rule: the per-layer fallback (torch.func)
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(5))

    def forward(self, x):
        return torch.sin(x) * self.w

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
odd = nn.Sequential(nn.Linear(6, 5), Scale(), nn.Linear(5, 3))
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
    "fallback": ("pv.per_sample_grads(odd, nn.CrossEntropyLoss(), x, y, strategy='hooks')", "sympy"),
    "scan": ("pv.scan(odd, nn.CrossEntropyLoss(), torch.utils.data.TensorDataset(x, y), out=sys.argv[1], "
             "progress=False)", "sympy"),
}


def _run(script: str, tmp_path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}  # as a user's process starts
    return subprocess.run([sys.executable, "-c", script, str(tmp_path / "scan")], env={**clean, **env}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("case", sorted(CALLS))
def test_a_first_call_leaves_no_filter_and_no_variable(case, tmp_path):
    call, module = CALLS[case]
    result = _run(SCRIPT.format(call=call, module=module), tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_users_own_relative_cache_directory_is_kept_as_written(tmp_path):
    """torch._dynamo's import writes the variable back made absolute: the user's own value is put back as it was."""
    call, module = CALLS["torch_func"]
    result = _run(SCRIPT.format(call=call, module=module), tmp_path, TORCHINDUCTOR_CACHE_DIR="relcache")
    assert result.returncode == 0, result.stderr[-2000:]


def test_only_pytorchs_own_setting_is_taken_back(monkeypatch):
    """A value another thread of the user's sets during a call is kept; torch's default directory is taken back."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from pergrad_viz.core import process

    monkeypatch.delenv(process.INDUCTOR_CACHE, raising=False)
    with process.leaving_process_as_found():
        os.environ[process.INDUCTOR_CACHE] = os.path.abspath(default_cache_dir())  # what torch._dynamo's import sets
    assert process.INDUCTOR_CACHE not in os.environ
    with process.leaving_process_as_found():
        os.environ[process.INDUCTOR_CACHE] = "/the/users/cache"
    assert os.environ[process.INDUCTOR_CACHE] == "/the/users/cache"
