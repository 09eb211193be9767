"""notebooks/03_explorer.ipynb: the interactive explorer."""

from nbbuild import code, md

CELLS = [
    md("""
# 03 · The explorer

Move the sliders: **batch size** and **hidden width** of the tutorial `MLP(784, hidden, 10)`, the quantity
(per-sample gradients or output Jacobian) and the strategies to compare. Each change re-times the selected
strategies on real sample images, redraws the runtime chart (and how it scales with batch size), the table
(speed-up vs the loop, memory of the result), a heatmap of the per-sample gradients and the first-layer
gradients of one sample as images, and checks that the strategies agree.

Slow baselines are skipped above a size limit, and the explorer says so. Run it in JupyterLab (`make lab`) or
as a dashboard with Voila (`voila notebooks/03_explorer.ipynb`).
"""),
    code("""
import pergrad_viz as pv

explorer = pv.widgets.explorer()
explorer
"""),
    md("""
## What the explorer is made of

The explorer is an ordinary ipywidgets box; its parts can be driven from code too (this is how its tests work).
"""),
    code("""
# NBVAL_CHECK_OUTPUT
for slider in (explorer.batch_slider, explorer.hidden_slider):
    print(f"{slider.description!r}: {slider.options[0]} .. {slider.options[-1]}, "
          f"value {slider.value}, continuous_update={slider.continuous_update}")
print("strategies:", list(explorer.strategy_boxes))
"""),
    code("""
# NBVAL_CHECK_OUTPUT
print("records for:", sorted({(r.quantity, r.batch_size, r.hidden) for r in explorer.records}))
print("methods:", [r.strategy for r in explorer.records if r.batch_size == explorer.batch_slider.value])
"""),
    code("""
# NBVAL_CHECK_OUTPUT
explorer.batch_slider.value = 8                 # what moving the slider does
print("records now for batch size:", sorted({r.batch_size for r in explorer.records}))
"""),
    code("""
# NBVAL_CHECK_OUTPUT
import re

diff = float(re.search(r"([0-9.]+e[-+][0-9]+)", explorer.status).group(1))
print("strategies agree to within 1e-4:", diff < 1e-4)
"""),
]
