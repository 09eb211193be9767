"""The chosen sample's panel: its input as drawn, its first-layer gradients as small images (or rows) and the fast
rule's two factors, computed here from one forward and backward of the sample alone and checked against the
per-sample gradient the heatmap shows. Pure: tensors in, a :class:`~pergrad_viz.explorer.state.SampleView` out.
"""

from __future__ import annotations

import torch
from torch import nn

from pergrad_viz.core.batch import Batch, cut
from pergrad_viz.explorer.specs import ModelSpec
from pergrad_viz.explorer.state import Computed, RuleView, SampleView, Setting

__all__ = ["first_layer_panel", "inputs_of", "rule_view", "sample_view"]

MAX_IMAGES = 9  # hidden units shown as images for a per-sample gradient


def sample_view(setting: Setting, spec: ModelSpec, data: Computed, jacobian: torch.Tensor | None) -> SampleView:
    """The chosen sample ``setting.sample`` (clamped to B-1): its input, its first-layer gradients as small
    images (or rows), its output Jacobian ``jacobian`` (Y, P) for that quantity (None for gradients), and the fast
    rule's parts."""
    i = max(0, min(setting.sample, setting.batch - 1))
    label = spec.label(int(data.labels[i]))
    one = Batch.of(data.x).sample(i)
    image = drawn(one, spec.sample_kind)
    layer = spec.first_layer
    module = dict(data.model.named_modules()).get(layer) if layer is not None else None
    jac = jacobian
    bounds = {n: (a, b) for n, a, b in data.boundaries}
    if module is None or f"{layer}.weight" not in bounds:
        rule = RuleView(layer or "-", None, note="this network has no Linear, Conv2d or Embedding layer with "
                                                 "trainable weights: no closed-form panel to draw")
        return SampleView(i, label, image, None, (), f"sample {i} ({label}) at {setting.short}", jac, rule,
                          spec.sample_kind)
    start, stop = bounds[f"{layer}.weight"]
    grad = data.grads[i, start:stop].reshape(module.weight.shape)
    rule = rule_view(data, one, i, layer, module, grad)
    images, titles, title = first_layer_panel(setting, spec, i, label, layer, grad, jac, start, stop)
    return SampleView(i, label, image, images, titles, title, jac, rule, spec.sample_kind)


def inputs_of(batch: Batch) -> object:
    """A batch's inputs as per_sample_grads takes them: a tensor, a tuple or a dict."""
    if batch.kwargs and not batch.args:
        return dict(batch.kwargs)
    if not batch.kwargs and len(batch.args) == 1:
        return batch.args[0]
    if not batch.kwargs:
        return tuple(batch.args)
    raise ValueError("inputs with both positional and keyword tensors cannot be drawn by the explorer")


def drawn(one: Batch, kind: str) -> torch.Tensor | None:
    """What the sample panel draws of one sample: the image (its pixels, any shape) or the (T,) token ids (a dict's
    ``input_ids``)."""
    if kind == "tokens" and not one.args and isinstance(one.kwargs.get("input_ids"), torch.Tensor):
        return one.kwargs["input_ids"][0].detach().cpu()
    if kind not in ("image", "tokens") or len(one.args) != 1 or not isinstance(one.args[0], torch.Tensor):
        return None
    return one.args[0][0].detach().cpu()


def layer_io(data: Computed, one: Batch, i: int, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, g) of sample i at ``module``: its input (1, ...) and the gradient of the sample's loss at its output
    (1, ...), from one forward and backward of the sample alone (a forward hook, removed at once)."""
    seen: dict[str, torch.Tensor] = {}

    def hook(_module, args, out):
        seen["a"], seen["out"] = args[0].detach(), out

    handle = module.register_forward_hook(hook)
    try:
        with torch.enable_grad():
            out = one(data.model)
    finally:
        handle.remove()
    with torch.enable_grad():
        target = cut(data.y, slice(i, i + 1), Batch.of(data.x).size)
        (g,) = torch.autograd.grad(data.loss_fn(out, target), seen["out"])
    return seen["a"], g.detach()


def rule_view(data: Computed, one: Batch, i: int, layer: str, module: nn.Module, grad: torch.Tensor) -> RuleView:
    """The closed-form rule of ``module`` (a Linear, Conv2d or Embedding) for sample i, its factors computed here
    from the layer's input and output gradient and checked against ``grad`` (the per-sample gradient of the
    weight, from per_sample_grads)."""
    a, g = layer_io(data, one, i, module)
    norm = float(grad.norm())
    vector = None
    if isinstance(module, nn.Linear):
        n_in, n_out = module.in_features, module.out_features
        if a.dim() == 2:  # one position: the outer product g a^T
            vector = (a[0], g[0])
            left, right = g[0][:, None], a[0][None]
            names = ("g_i: the backprop signal at the output", "a_i^T: the layer's input", "g_i a_i^T")
        else:  # a sequence: the sum over positions of g_t a_t^T
            left, right = g.reshape(-1, n_out).T, a.reshape(-1, n_in)
            names = ("G_i^T: the signal at each position", "A_i: the input at each position", "G_i^T A_i")
        kind = "linear"
    elif isinstance(module, nn.Conv2d):
        if module.groups != 1 or module.padding_mode != "zeros" or isinstance(module.padding, str):
            return RuleView(layer, None, note=f"{layer} is a grouped / padded-by-mode convolution: its rule (the "
                                              "unfolded patches per group) is not drawn here", gradient_norm=norm)
        patches = nn.functional.unfold(a, module.kernel_size, dilation=module.dilation, padding=module.padding,
                                       stride=module.stride)[0]  # (C_in k k, L)
        left, right = g[0].reshape(module.out_channels, -1), patches.T  # (C_out, L), (L, C_in k k)
        names = ("G_i: the signal at each output position", "U_i^T: the unfolded input patches", "G_i U_i^T")
        kind = "conv"
    elif isinstance(module, nn.Embedding):
        if module.max_norm is not None or module.scale_grad_by_freq:
            return RuleView(layer, None, note=f"{layer} renormalises or scales by frequency: not drawn here",
                            gradient_norm=norm)
        tokens = a.reshape(-1)
        left = nn.functional.one_hot(tokens, module.num_embeddings).to(g.dtype).T  # (V, T)
        if module.padding_idx is not None:
            left[module.padding_idx] = 0  # the padding row gets no gradient
        right = g.reshape(-1, module.embedding_dim)  # (T, d)
        names = ("O_i^T: the one-hot rows of the sample's tokens", "G_i: the signal at each token",
                 "O_i^T G_i: rows of the used tokens")
        kind = "embedding"
    else:
        return RuleView(layer, None, note=f"{layer} ({type(module).__name__}) has no closed-form panel here",
                        gradient_norm=norm)
    product = left @ right
    difference = float((product - grad.reshape(product.shape)).abs().max())
    return RuleView(layer, kind, "", left, right, product, names, *(vector or (None, None)), norm, difference)


def first_layer_panel(setting: Setting, spec: ModelSpec, i: int, label: str, layer: str, grad: torch.Tensor,
                       jac: torch.Tensor | None, start: int, stop: int
                       ) -> tuple[torch.Tensor, tuple[str, ...], str]:
    """(first_layer, titles, title) of the sample panel: the first rule layer's weight gradient as (K, h, w) small
    images (a Linear on 28x28 images: one per hidden unit; a convolution: its kernels) or as a (R, C) matrix (an
    embedding's rows, one per token id; any other layer's rows); with a Jacobian, its outputs' sensitivity."""
    names = spec.class_names
    where = f"sample {i} ({label}) at {setting.short}"
    shape = grad.shape
    if jac is not None:
        first = jac[:, start:stop].reshape(jac.shape[0], *shape)  # (Y, *weight)
        outputs = tuple(names[:jac.shape[0]]) if names and len(names) >= jac.shape[0] else tuple(
            f"output {c}" for c in range(jac.shape[0]))
        if first.dim() == 3 and shape[1] == 784:  # rows of a Linear on images
            unit = int(first.square().sum(dim=(0, 2)).argmax())
            return (first[:, unit].reshape(-1, 28, 28), outputs,
                    f"{where}: d output_c / d {layer}.weight[{unit}, :] for each class c (hidden unit {unit}, the "
                    "most sensitive)")
        if first.dim() == 5:  # a convolution's kernels
            flat = first.reshape(first.shape[0], -1, *shape[2:])
            kernel = int(flat.square().sum(dim=(0, 2, 3)).argmax())
            return (flat[:, kernel], outputs, f"{where}: d output_c / d {layer}.weight (kernel {kernel}, the most "
                                               "sensitive) for each class c")
        rows = first.reshape(first.shape[0], shape[0], -1).norm(dim=2)  # (Y, rows)
        return (rows, outputs, f"{where}: ||d output_c / d {layer}.weight[row, :]|| for each class c and row")
    if grad.dim() == 2 and shape[1] == 784:
        units = grad.norm(dim=1).topk(min(MAX_IMAGES, shape[0])).indices.tolist()
        return (grad[units].reshape(-1, 28, 28), tuple(f"unit {j}" for j in units),
                f"{where}: its gradient w.r.t. {layer}.weight, the {len(units)} hidden units with the largest "
                "gradient (each is the input times one number)")
    if grad.dim() == 4:
        flat = grad.reshape(-1, *shape[2:])  # (C_out C_in, k, k)
        top = flat.flatten(1).norm(dim=1).topk(min(MAX_IMAGES, flat.shape[0])).indices.tolist()
        return (flat[top], tuple(f"out {j // shape[1]}, in {j % shape[1]}" for j in top),
                f"{where}: its gradient w.r.t. {layer}.weight, the {len(top)} kernels with the largest gradient")
    matrix = grad.reshape(shape[0], -1)
    return (matrix, tuple(str(k) for k in range(shape[0])),
            f"{where}: its gradient w.r.t. {layer}.weight, one row per "
            + ("token id (only the sample's tokens have one)" if spec.sample_kind == "tokens" else "output unit"))

