"""``explorer()``: the explorer widget built from its options (a menu of networks, or the user's own network and
data), each checked before anything is computed.

>>> import pergrad_viz as pv
>>> pv.widgets.explorer()          # in a notebook cell: the widget shows itself (a menu of networks)
>>> pv.widgets.explorer(model=net, loss_fn=loss_fn, data=(x, y))     # your own network on your data
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence

import torch
from torch import nn

from pergrad_viz.explorer.model import ExplorerModel
from pergrad_viz.explorer.specs import menu, user_spec
from pergrad_viz.explorer.state import QUANTITIES, Setting
from pergrad_viz.explorer.view import DPI, Explorer
from pergrad_viz.strategies import STRATEGIES

__all__ = ["explorer"]

POWERS_OF_TWO_BATCH = tuple(2**k for k in range(9))  # 1 .. 256
POWERS_OF_TWO_HIDDEN = tuple(2**k for k in range(3, 10))  # 8 .. 512


def _options(values: Sequence[int], default: int, what: str) -> tuple[int, ...]:
    options = sorted({int(v) for v in values} | {int(default)})
    if options[0] < 1:
        raise ValueError(f"{what} must be positive integers, got {tuple(values)}")
    return tuple(options)


def _checked_device(threads: object, device: object, model: nn.Module | None) -> str:
    """Where to compute: your own network's device (where its parameters are), else ``device`` (None: the CPU).
    ValueError naming the fix for a thread count that is not a positive integer, a device torch does not know or has
    not got, or ``device=`` naming another device than your own network's."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, numbers.Integral)
                                or threads < 1):
        raise ValueError(f"threads must be a positive number of intra-op threads (None: all cores but one), got "
                         f"{threads!r}")
    own = next(model.parameters(), torch.empty(0)).device if isinstance(model, nn.Module) else None  # else: refused
    if device is None:
        return "cpu" if own is None else str(own)
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be a device torch knows ('cpu', 'cuda', 'cuda:0'), got {device!r}") from e
    if own is not None:
        if kind != own.type:
            raise ValueError(f"device={device!r}: your network is computed where its parameters are ({own}); move it "
                             "with model.to(device) first, or leave device= out")
        return str(own)
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}, but torch finds no CUDA device here: leave device= out (the CPU)")
    return device


def explorer(*, model: nn.Module | None = None, loss_fn: Callable | None = None, data: object = None,
             class_names: Sequence[str] | None = None, models: Sequence[str] | None = None,
             default_model: str = "mlp", batch_sizes: Sequence[int] = POWERS_OF_TWO_BATCH,
             hidden_widths: Sequence[int] = POWERS_OF_TWO_HIDDEN, strategies: Sequence[str] = STRATEGIES,
             default_batch: int | None = None, default_hidden: int = 20, quantity: str = "grads",
             slow_limit: int = 1024, rounds: int = 5, sweep_batches: int = 3, device: str = "cpu", dpi: float = DPI,
             threads: int | None = None, background: bool = True, compute: bool = True, ahead: bool = True,
             output: Callable[[object], object] | None = None, **model_options) -> Explorer:
    """The interactive explorer of the strategies: on a menu of networks (the tutorial ``MLP(784, hidden, 10)``
    first, a small CNN, a transformer encoder, an LSTM classifier, a tiny ViT with LoRA adapters), or on your own
    network and data.

    Args:
        model, loss_fn, data: your own network, its loss (``loss_fn(model(inputs), targets)``, summed over the
            samples) and data: ``(inputs, targets)`` (inputs as ``per_sample_grads`` takes them: a tensor, a tuple,
            a dict; the samples first), a Dataset of ``(input, target)`` pairs or a DataLoader. The batch-size slider
            runs over the first samples (up to 256); the network is used as it is: never trained, moved or changed.
        class_names: names of your targets' classes (targets that are class indices or one-hot rows).
        models: the menu's networks to offer (default all: ``"mlp", "cnn", "transformer", "lstm"`` and, where
            transformers and peft are installed, ``"vit-lora"``);
            default_model: the one shown first.
        batch_sizes, hidden_widths: the sliders' options (default powers of two, 1..256 and, for the MLP, 8..512;
            each other network has its own widths, see :data:`~.specs.MENU`).
        strategies: one checkbox each (names from :data:`pergrad_viz.STRATEGIES`, or ``"auto"``).
        default_batch, default_hidden: the sliders' start values (added to the options where absent: the
            tutorial's hidden width 20 sits between 16 and 32; default_hidden is the MLP's).
        quantity: ``"grads"`` (per-sample gradients, (B, P)) or ``"jacobian"`` (output Jacobians, (B, Y, P)).
        slow_limit: ``loop``, ``autograd_stack`` and ``batched_grad`` are skipped, with a visible note, where
            they would push more than this many samples through backward passes per call (the loop: B for
            gradients, B x Y for Jacobians; the other two B times that, see ``bench.sweeps.backward_work``); the
            explorer's "time slow methods up to" control starts here.
        rounds: interleaved timing rounds per method (fewer, down to 3, for expensive ones).
        sweep_batches: how many batch sizes (up to the current one) are timed for the scaling curve.
        device: where to compute the menu's networks (yours stays where it is). dpi: pixels per inch of the figures.
        threads: intra-op threads while computing (default: all cores but one); set for each step of the work
            and the process's own count restored after it.
        background: work in a background thread (False: in the control's callback, e.g. for tests).
        compute: start on the default setting now.
        ahead: while the explorer idles (its setting done, no control moved), compute the menu's other networks
            ahead, one at a time, giving way at once to any control: their first visits then show at once.
        output: with ``model=``, the tensor of your model's output its Jacobian is of (``per_sample_jacobian``'s
            ``output=``), e.g. ``lambda out: out.logits`` for a Hugging Face model.
        model_options: more :class:`~.model.ExplorerModel` options (``min_block_s``, ``tier_budget_s`` ...).

    Returns:
        The :class:`Explorer`; as a cell's last expression it shows itself.
    """
    if quantity not in QUANTITIES:
        raise ValueError(f"quantity must be one of {', '.join(map(repr, QUANTITIES))}, got {quantity!r}")
    device = _checked_device(threads, device, model)
    if model is not None:
        if loss_fn is None or data is None:
            raise ValueError("explorer(model=...) needs loss_fn= and data=(inputs, targets) (or a Dataset / "
                             "DataLoader) too")
        spec = user_spec(model, loss_fn, data, max_batch=max(batch_sizes), class_names=class_names, output=output)
        specs = {spec.key: spec}
        batch_sizes = tuple(sorted({b for b in batch_sizes if b <= spec.max_batch} | {spec.max_batch}))  # all of it
        default_model, default_hidden = spec.key, 0
        default_batch = default_batch if default_batch is not None else min(spec.default_batch, max(batch_sizes))
        if default_batch > spec.max_batch:
            raise ValueError(f"default_batch={default_batch} is past the batch-size slider, which runs up to "
                             f"{spec.max_batch} (the smaller of the data's samples and max(batch_sizes)="
                             f"{max(batch_sizes)}): choose at most {spec.max_batch}")
    else:
        if loss_fn is not None or data is not None or output is not None:
            raise ValueError("loss_fn=, data= and output= go with model=: pass your network too")
        specs = dict(menu(models))
        if default_model not in specs:
            raise ValueError(f"default_model {default_model!r} is not among the models {list(specs)}")
        default_batch = default_batch if default_batch is not None else 32
        if default_model != "mlp":
            default_hidden = specs[default_model].default_width
    batch_sizes = _options(batch_sizes, default_batch, "batch_sizes")
    widths = {key: spec.widths for key, spec in specs.items()}
    if "mlp" in specs:
        widths["mlp"] = _options(hidden_widths, default_hidden if default_model == "mlp" else 20, "hidden_widths")
    unknown = [s for s in strategies if s != "auto" and s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; valid: 'auto', {', '.join(STRATEGIES)}")
    if rounds < 1 or sweep_batches < 1:
        raise ValueError(f"rounds and sweep_batches must be at least 1, got {rounds} and {sweep_batches}")
    if not (math.isfinite(dpi) and dpi > 0):
        raise ValueError(f"dpi must be a positive number, got {dpi!r}")
    explorer_model = ExplorerModel(batch_options=batch_sizes, slow_limit=slow_limit, rounds=rounds,
                                   sweep_batches=sweep_batches, device=device, threads=threads, models=specs,
                                   **model_options)
    default = Setting(model=default_model, batch=default_batch, hidden=default_hidden, quantity=quantity,
                      strategies=tuple(strategies))
    return Explorer(explorer_model, batch_sizes=batch_sizes, hidden_widths=widths[default_model],
                    strategies=tuple(strategies), default=default, dpi=dpi, background=background, compute=compute,
                    widths=widths, ahead=ahead)
