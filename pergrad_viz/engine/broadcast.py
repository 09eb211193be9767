"""Parameters broadcast over the batch, on the fast path: a class token, a position embedding, a learned offset of
shape (1, ...) that a layer without a rule adds or concatenates in its own forward (``x + self.pos_embed``,
``torch.cat([self.cls_token.expand(B, -1, -1), x], 1)``).

Such a parameter would send its whole layer (often the model itself: timm's ``VisionTransformer``, Hugging Face's
``ViTEmbeddings``) to the per-layer fallback, which runs that layer once per sample under ``torch.func``. Instead,
during the one batched forward pass of the hooks strategy, the parameter p (1, *rest) is replaced by a tensor E
(B, *rest), row b a copy of p: every use of p that broadcasts over the batch uses row b for sample b, so the
gradient at E, from the same single backward pass, is sample b's gradient of p in row b.

That holds only where every use of p broadcasts its first dimension against the batch; a use that reads p's first
dimension any other way (``p[0]``, ``p.squeeze(0)``, ``p.mean(0)``) does not. Nothing of this is assumed, it is
measured once per plan (:func:`check`, called by the probe on its pair of samples): with the copies in, the model
must give the same outputs as without, and the gradient at the copies for a random cotangent must equal, row by
row, each sample's own gradient of p from a run alone. Only then does the layer take this path (``LayerKind``
``BROADCAST``); and every call is still checked by the per-call check (:mod:`pergrad_viz.engine.certify`).
Shapes: B samples; a copy E is (B, *rest) for a parameter (1, *rest); its gradient (N, B, *rest).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from pergrad_viz.core.batch import Batch
from pergrad_viz.core.ownership import holders
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.engine.observe import close, tensors_of


def candidate(trainable: Trainable, local: Mapping[str, str]) -> bool:
    """Whether every parameter a layer handles ({local name: full name}) is its own (not a child's), held by this
    layer only (not tied) and has a first dimension of size 1: the parameters this path may take."""
    params = dict(zip(trainable.names, trainable.params, strict=True))
    held = holders(trainable.modules)
    return bool(local) and all(
        "." not in ln and params[fn].dim() >= 1 and params[fn].shape[0] == 1 and len(held.get(id(params[fn]), [])) == 1
        for ln, fn in local.items())


def copies(params: Mapping[str, torch.Tensor], batch: int) -> dict[str, torch.Tensor]:
    """{name: E (batch, *rest)}: a per-sample copy of each parameter (1, *rest), a leaf that requires grad (an
    expanded view: no memory per sample)."""
    return {name: p.detach().expand(batch, *p.shape[1:]).requires_grad_() for name, p in params.items()}


@contextmanager
def substituted(modules: Mapping[str, nn.Module], layers: Mapping[str, Mapping[str, torch.Tensor]]
                ) -> Iterator[None]:
    """Within the block, module ``name``'s own parameter ``ln`` reads as ``layers[name][ln]``; restored after it,
    also on error (the module's ``_parameters`` entries are put back as they were)."""
    saved = []
    try:
        for name, values in layers.items():
            own = modules[name]._parameters
            for ln, value in values.items():
                saved.append((own, ln, own[ln]))
                own[ln] = value
        yield
    finally:
        for own, ln, p in reversed(saved):
            own[ln] = p


def check(trainable: Trainable, inputs: Batch, index: torch.Tensor, layers: Mapping[str, Mapping[str, str]]
          ) -> bool:
    """Whether the copies give the per-sample definition on the samples ``index`` (2,) of ``inputs``: the same
    outputs as the model itself, and at the copies, for a random cotangent u on the outputs, row r of the gradient
    equal to sample r's gradient of u_r . output_r when it runs alone. ``layers``: {module name: {local: full}}."""
    modules = dict(trainable.modules)
    params = dict(zip(trainable.names, trainable.params, strict=True))
    pair = inputs.rows(index)
    with torch.enable_grad():
        want = [t for t in tensors_of(pair(trainable.model)) if t.requires_grad]
        made = {name: copies({ln: params[fn] for ln, fn in local.items()}, 2) for name, local in layers.items()}
        try:
            with substituted(modules, made):
                got = [t for t in tensors_of(pair(trainable.model)) if t.requires_grad]
        except (RuntimeError, ValueError, TypeError, IndexError):  # a use that cannot take a (2, ...) copy
            return False
        leaves = [e for values in made.values() for e in values.values()]
        full = [params[fn] for local in layers.values() for fn in local.values()]

        def alone(r: int, cotangents: list[torch.Tensor]) -> tuple | None:
            outputs = [t for t in tensors_of(inputs.sample(int(index[r]))(trainable.model)) if t.requires_grad]
            if len(outputs) != len(cotangents):
                return None
            return torch.autograd.grad(outputs, full, cotangents, allow_unused=True)

        return _rows_agree(want, got, leaves, alone)


def _rows_agree(want: list[torch.Tensor], got: list[torch.Tensor], leaves: list[torch.Tensor], alone) -> bool:
    """The probe's pair run with per-sample copies in (``got``, its copies ``leaves`` (2, ...)) against the same pair
    run as the model is (``want``): the same outputs, and for a random cotangent u on them, row r of the gradient at
    the copies equal to ``alone(r, [u_r (1, ...)])``, the gradients at the same places when sample r runs alone (None
    where that run's outputs do not match)."""
    if len(got) != len(want) or not all(close(g.detach(), w.detach()) for g, w in zip(got, want, strict=True)):
        return False
    if not leaves or not all(t.dim() >= 1 and t.shape[0] == 2 for t in got):
        return False
    gen = torch.Generator(device=got[0].device).manual_seed(20261201)
    cotangents = [torch.randn(t.shape, generator=gen, dtype=t.dtype, device=t.device) for t in got]
    rows = torch.autograd.grad(got, leaves, cotangents, allow_unused=True)
    for r in (0, 1):
        own = alone(r, [c[r:r + 1] for c in cotangents])
        if own is None or len(own) != len(rows):
            return False
        for g_row, g_own in zip(rows, own, strict=True):
            if g_row is None or g_own is None:
                if g_row is not g_own:  # used in one run only
                    return False
                continue
            if not close(g_row[r].detach(), g_own[0].detach()):
                return False
    return True


# ------------------------------------------------------------------- layers whose output is shared by the samples


def shared_call(in_dims: tuple, in_rest: tuple, out_dims: tuple, out_rest: tuple) -> bool:
    """Whether a call of a layer holds no samples, one tensor in and one out, each with a first dimension of size 1:
    a position embedding of shared ids (1, T) -> (1, T, D) that the model then adds to every sample."""
    return (in_dims == (None,) and out_dims == (None,) and in_rest[0][:1] == (1,) and out_rest[0][:1] == (1,))


def spread(output: torch.Tensor, batch: int, keep_graph: bool = False) -> torch.Tensor:
    """A shared output (1, *rest) as a per-sample copy (batch, *rest): a leaf that requires grad (an expanded view);
    ``keep_graph``: an expanded view of the output itself, through which the gradient goes on to the call's inputs
    (a learned query (1, D) that the layer is applied to: its gradient comes through the layer)."""
    if keep_graph and output.requires_grad:
        return output.expand(batch, *output.shape[1:])
    return output.detach().expand(batch, *output.shape[1:]).requires_grad_()


def check_outputs(trainable: Trainable, inputs: Batch, index: torch.Tensor, names: list[str]) -> bool:
    """Like :func:`check`, for layers whose output is shared (``names``): with each output handed downstream as a
    per-sample copy, the same model outputs, and at the copies, row r of the gradient for a random cotangent equal to
    the gradient at that layer's output when sample r runs alone."""
    modules = dict(trainable.modules)
    made: list[torch.Tensor] = []

    def run(batch: Batch, size: int | None) -> list[torch.Tensor]:
        made.clear()
        hook = (lambda module, args, output: made.append(spread(output, size)) or made[-1]) if size else (
            lambda module, args, output: made.append(output.detach().requires_grad_()) or made[-1])
        handles = [modules[name].register_forward_hook(hook) for name in names]
        try:
            return [t for t in tensors_of(batch(trainable.model)) if t.requires_grad]
        finally:
            for h in handles:
                h.remove()

    pair = inputs.rows(index)
    with torch.enable_grad():
        want = [t for t in tensors_of(pair(trainable.model)) if t.requires_grad]
        try:
            got = run(pair, 2)
        except (RuntimeError, ValueError, TypeError, IndexError):
            return False
        leaves = list(made)

        def alone(r: int, cotangents: list[torch.Tensor]) -> tuple | None:
            outputs = run(inputs.sample(int(index[r])), None)
            if len(outputs) != len(cotangents) or len(made) != len(leaves):
                return None
            return torch.autograd.grad(outputs, list(made), cotangents, allow_unused=True)

        return _rows_agree(want, got, leaves, alone)
