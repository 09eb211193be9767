import numpy as np
import pytest
import torch

from pergrad_viz import viz


def test_image_grid_titles_and_axes():
    fig = viz.image_grid(torch.rand(5, 784), titles=[f"t{i}" for i in range(5)], ncols=3)
    shown = [a for a in fig.axes if a.images]
    assert len(shown) == 5 and len(fig.axes) == 6  # 2 rows x 3 columns, one empty
    assert [a.get_title() for a in shown] == [f"t{i}" for i in range(5)]
    with pytest.raises(ValueError, match="titles"):
        viz.image_grid(torch.rand(2, 784), titles=["a"])


def test_norm_histogram_counts_and_threshold_line():
    before, after = torch.tensor([0.5, 2.0, 3.0]), torch.tensor([0.5, 1.0, 1.0])
    fig = viz.norm_histogram(before, after, 1.0)
    ax = fig.axes[0]
    heights = [sum(p.get_height() for p in c) for c in ax.containers]
    assert heights == [3, 3]
    assert ax.lines[0].get_xdata()[0] == 1.0


def test_grouped_heatmap_boundaries_and_symmetric_limits():
    m = np.array([[1.0, -0.5, 0.2], [-0.5, 1.0, 0.1], [0.2, 0.1, 2.0]])
    fig = viz.grouped_heatmap(m, [0, 0, 1], group_names=["a", "b"])
    ax = fig.axes[0]
    assert ax.images[0].get_clim() == (-2.0, 2.0)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b"]
    assert ax.lines[0].get_ydata()[0] == 1.5  # between the two groups
    with pytest.raises(ValueError, match="sorted"):
        viz.grouped_heatmap(m, [1, 0, 0])


def test_empty_inputs_are_refused_naming_what_to_pass():
    """Found by a probe: no images gave numpy's IndexError, no norms its "zero-size array" error."""
    with pytest.raises(ValueError, match="K >= 1"):
        viz.image_grid(torch.rand(0, 28, 28))
    with pytest.raises(ValueError, match="no norms to plot"):
        viz.norm_histogram(torch.zeros(0), torch.zeros(0), 1.0)
