"""Each extra's features, with the extra's package missing (blocked in sys.modules), raise MissingExtraError (an
ImportError) naming the extra: pip install 'pergrad-viz[EXTRA]'; progress bars fall back to a plain one without
tqdm."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from pergrad_viz.bench import peers, problems
from pergrad_viz.core import progress
from pergrad_viz.errors import MissingExtraError
from pergrad_viz.tutorial import hf_models
from pergrad_viz.tutorial.data import load_sample


def _names(info: pytest.ExceptionInfo, extra: str, package: str) -> None:
    assert isinstance(info.value, ImportError)
    assert f"pip install 'pergrad-viz[{extra}]'" in str(info.value)
    assert f"needs {package}, which is not installed" in str(info.value)


@pytest.mark.parametrize(
    ("blocked", "extra", "package", "call"),
    [
        ("torchvision", "tutorial", "torchvision",
         lambda: load_sample(5, dataset="mnist", root="/nonexistent", download=True)),
        ("torchvision", "bench", "torchvision", lambda: problems.problem("resnet18", 2)),
        ("opacus", "peers", "opacus", lambda: peers.make_peer("opacus", nn.Linear(2, 2), nn.MSELoss(),
                                                              torch.zeros(2, 2), torch.zeros(2, 2))),
        ("backpack", "peers", "backpack-for-pytorch",
         lambda: peers.make_peer("backpack", nn.Linear(2, 2), nn.MSELoss(), torch.zeros(2, 2), torch.zeros(2, 2))),
        ("transformers", "hf", "transformers", hf_models.gpt2),
        ("timm", "hf", "timm", hf_models.timm_vit),
    ],
)
def test_a_feature_names_its_extra(monkeypatch, blocked, extra, package, call):
    monkeypatch.setitem(sys.modules, blocked, None)
    with pytest.raises(MissingExtraError) as info:
        call()
    _names(info, extra, package)


BLOCKED = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None
from pergrad_viz.errors import MissingExtraError
import pergrad_viz as pv
try:
    {statement}
except MissingExtraError as e:
    print(e)
else:
    print("no error")
"""


@pytest.mark.parametrize(
    ("blocked", "statement", "extra", "package"),
    [
        (["matplotlib"], "pv.viz", "viz", "matplotlib"),
        (["matplotlib"], "from pergrad_viz.viz import gradient_heatmap", "viz", "matplotlib"),
        (["matplotlib"], "pv.widgets.explorer", "widgets", "matplotlib"),
        (["ipywidgets"], "pv.widgets.explorer", "widgets", "ipywidgets"),
        (["IPython"], "from pergrad_viz.widgets import explorer", "widgets", "ipython"),
        # found by a probe: the explorer's own modules, imported directly, raised a raw ModuleNotFoundError
        (["ipywidgets"], "import pergrad_viz.explorer.view", "widgets", "ipywidgets"),
        (["ipywidgets"], "import pergrad_viz.explorer.factory", "widgets", "ipywidgets"),
        (["matplotlib"], "import pergrad_viz.explorer.panels", "widgets", "matplotlib"),
    ],
)
def test_figures_and_the_explorer_name_their_extra(blocked, statement, extra, package):
    result = subprocess.run([sys.executable, "-c", BLOCKED.format(blocked=blocked, statement=statement)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert f"needs {package}, which is not installed: pip install 'pergrad-viz[{extra}]'" in result.stdout


def test_the_computations_import_without_the_extras():
    code = ("import sys\n"
            "for name in ('matplotlib', 'ipywidgets', 'IPython', 'torchvision', 'tqdm', 'transformers', 'timm',"
            " 'peft', 'opacus', 'backpack'):\n    sys.modules[name] = None\n"
            "import torch, pergrad_viz as pv\n"
            "from pergrad_viz.cli.main import build_parser\n"
            "m = torch.nn.Linear(3, 2)\n"
            "g = pv.per_sample_grads(m, torch.nn.MSELoss(), torch.randn(4, 3), torch.randn(4, 2), flat=True)\n"
            "print(tuple(g.shape))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["(4,", "8)"]


def test_without_tqdm_the_progress_bar_is_plain(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    bar = progress.progress_bar(total=20, desc="scan", unit="ex", leave=False)
    assert isinstance(bar, progress.PlainBar)
    for _ in range(4):
        bar.update(5)
    bar.set_postfix_str("done")
    bar.close()
    bar.update(5)  # closed: silent
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["scan: 5/20 ex", "scan: 10/20 ex", "scan: 15/20 ex", "scan: 20/20 ex"]
    quiet = progress.progress_bar(total=3, desc="x", unit="y", disable=True)
    quiet.update(3)
    assert capsys.readouterr().err == ""
