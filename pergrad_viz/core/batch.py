"""What "sample i" of a call is: the one definition every strategy, the probe, chunking and the checks use.

A call's inputs are what the model takes: a tensor ``x`` (``model(x)``), a tuple or list (``model(*inputs)``), or a
dict / Mapping such as a tokenizer's ``BatchEncoding`` (``model(**inputs)``), with optional extra keyword arguments
(``model_kwargs``). Targets are a tensor or a tuple / dict of them. B, the batch size, is the first dimension of the
targets (or, without targets, of the first tensor among the inputs). Sample i is cut from every tensor whose first
dimension is B (``t[i:i+1]``, a batch of one); every other value passes unchanged (a shared (T, T) mask, ``None``,
flags, numbers). A shared tensor whose first dimension happens to equal B would be cut too: hand such a tensor to the
model another way (an attribute, a closure). A part of the batch (a chunk, one sample: :meth:`Batch.rows`) keeps
what was shared shared, whatever its first dimension. All tensors must be on one device.

Shapes: B samples; a batched leaf is (B, ...), a shared leaf any shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.utils._pytree import SUPPORTED_NODES, keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten

from pergrad_viz.core.norm_grads import contiguous_norm_grads

Inputs = torch.Tensor | Sequence | Mapping


def _is_batched(t: object, size: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == size


def cut(obj: object, rows: slice | torch.Tensor, size: int) -> object:
    """``obj`` (a tensor or a nest of them) with ``t[rows]`` for every tensor whose first dimension is ``size``."""
    if isinstance(obj, torch.Tensor):
        return obj[rows] if _is_batched(obj, size) else obj
    if obj is None:
        return None
    leaves, spec = tree_flatten(obj)
    return tree_unflatten([t[rows] if _is_batched(t, size) else t for t in leaves], spec)


def first_tensor(obj: object) -> torch.Tensor | None:
    """The first tensor of ``obj`` (a tensor, or a pytree of them: tuple, list, dict) in pytree order, else None."""
    return next((t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)), None)


# The spec of the most common call, one tensor (``model(x)``): the fast paths below skip the pytree for it and give
# exactly what the general path gives (the same spec, leaves and cuts).
_ONE_TENSOR_SPEC = str(tree_flatten(((torch.zeros(()),), {}))[1])


@dataclass(frozen=True)
class Batch:
    """A call's inputs as ``model(*args, **kwargs)``, and B."""

    args: tuple
    kwargs: dict
    size: int
    # Positions (in the pytree order of (args, kwargs)) of shared tensors whose first dimension is ``size`` all the
    # same: a part's (:meth:`rows`) shared (4, 4) mask in a chunk of 4 samples is not 4 samples.
    shared: frozenset[int] = frozenset()

    @property
    def tensor(self) -> torch.Tensor | None:
        """The one input tensor of a call ``model(x)`` (no other argument), else None: the fast paths' case."""
        if len(self.args) == 1 and not self.kwargs and isinstance(self.args[0], torch.Tensor):
            return self.args[0]
        return None

    def _batched(self, flat: Sequence[object]) -> list[bool]:
        """Per value of ``flat`` (the pytree leaves of (args, kwargs)): whether it is a batched tensor (B, ...)."""
        if not self.shared:
            return [_is_batched(t, self.size) for t in flat]
        return [_is_batched(t, self.size) and k not in self.shared for k, t in enumerate(flat)]

    def _part(self, flat: Sequence[object], batched: Sequence[bool], spec: object, size: int) -> Batch:
        """The call of the values ``flat`` (those of ``batched`` now ``size`` samples), the shared ones whose first
        dimension is ``size`` noted as shared."""
        shared = frozenset(k for k, (t, b) in enumerate(zip(flat, batched, strict=True))
                           if not b and _is_batched(t, size))
        args, kwargs = tree_unflatten(list(flat), spec)
        return Batch(args, kwargs, size, shared)

    @classmethod
    def of(cls, inputs: Inputs, model_kwargs: Mapping | None = None, size: int | None = None) -> Batch:
        """The batch of ``inputs`` (see the module docstring); ``size``: B when the targets already say it."""
        if isinstance(inputs, torch.Tensor):
            args, kwargs = (inputs,), {}
        elif isinstance(inputs, Mapping):
            args, kwargs = (), dict(inputs)
        elif isinstance(inputs, (tuple, list)):
            args, kwargs = tuple(inputs), {}
        else:
            raise TypeError(
                f"inputs must be a torch.Tensor (model(x)), a tuple or list (model(*inputs)) or a dict "
                f"(model(**inputs)) of tensors with the samples first, got {type(inputs).__name__}"
            )
        if model_kwargs:
            clash = sorted(set(kwargs) & set(model_kwargs))
            if clash:
                raise ValueError(f"{clash} given both in inputs and in model_kwargs: pass each argument once")
            kwargs.update(model_kwargs)
        first = inputs if isinstance(inputs, torch.Tensor) and not model_kwargs else first_tensor((args, kwargs))
        if first is None:
            held = next((v for v in (*args, *kwargs.values()) if dataclasses.is_dataclass(v)), None)
            also = (f" (a {type(held).__name__} dataclass is passed whole, its tensors not seen: pass its fields as "
                    "a dict, dataclasses.asdict(...), for model(**fields))") if held is not None else ""
            raise TypeError(
                f"inputs must be a torch.Tensor of shape (B, ...), or a tuple / dict of tensors, got a "
                f"{type(inputs).__name__} holding no tensor{also}")
        if size is None:
            if first.dim() == 0:
                raise ValueError(f"empty batch: the first input tensor is a scalar {tuple(first.shape)}; pass at least "
                                 "one sample (B >= 1) with the samples first")
            size = first.shape[0]
        if size == 0 and first.dim() and first.shape[0]:  # B read from the targets
            raise ValueError(f"batch sizes differ: targets hold no sample but inputs has shape {tuple(first.shape)}; "
                             "pass one target per input sample")
        if size == 0:
            raise ValueError(f"empty batch: inputs has shape {tuple(first.shape)}; pass at least one sample (B >= 1)")
        return cls(args, kwargs, size)

    def sharing_as(self, other: Batch) -> Batch:
        """This call with the tensors ``other`` (a call of the same form) passes whole passed whole here too, whatever
        their first dimension (the NTK's x2 beside x1: a shared (4, 4) mask is not 4 samples of x2)."""
        flat, spec = tree_flatten((self.args, self.kwargs))
        theirs, their_spec = tree_flatten((other.args, other.kwargs))
        if str(spec) != str(their_spec):
            return self
        whole = frozenset(k for k, (t, b) in enumerate(zip(theirs, other._batched(theirs), strict=True))
                          if isinstance(t, torch.Tensor) and not b and _is_batched(flat[k], self.size))
        return dataclasses.replace(self, shared=self.shared | whole)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """The same call with ``fn`` applied to every tensor."""
        t = self.tensor
        if t is not None:
            return Batch((fn(t),), {}, self.size, self.shared)
        flat, spec = tree_flatten((self.args, self.kwargs))
        args, kwargs = tree_unflatten([fn(t) if isinstance(t, torch.Tensor) else t for t in flat], spec)
        return Batch(args, kwargs, self.size, self.shared)

    def leaves(self) -> list[torch.Tensor]:
        """The batched tensors (B, ...), in ``(args, kwargs)`` pytree order."""
        t = self.tensor
        if t is not None and not self.shared:
            return [t] if _is_batched(t, self.size) else []
        flat = tree_flatten((self.args, self.kwargs))[0]
        return [t for t, b in zip(flat, self._batched(flat), strict=True) if b]

    def named_leaves(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor with a readable name (``inputs[0]``, ``attention_mask``), for messages."""
        if len(self.args) == 1 and not self.kwargs and isinstance(self.args[0], torch.Tensor):
            return [("inputs", self.args[0])]
        named = [(f"inputs[{k}]", t) for k, t in enumerate(self.args) if isinstance(t, torch.Tensor)]
        named += [(k, t) for k, t in self.kwargs.items() if isinstance(t, torch.Tensor)]
        return named

    def rows(self, rows: slice | torch.Tensor) -> Batch:
        """Samples ``rows`` (a slice or an index tensor) as a batch."""
        n = len(range(self.size)[rows]) if isinstance(rows, slice) else int(rows.numel())
        t = self.tensor
        if t is not None and not self.shared:
            batched = _is_batched(t, self.size)
            part = t[rows] if batched else t
            return _one_tensor(part, batched, n)
        flat, spec = tree_flatten((self.args, self.kwargs))
        batched = self._batched(flat)
        return self._part([t[rows] if b else t for t, b in zip(flat, batched, strict=True)], batched, spec, n)

    def versions(self, apart_from: torch.Tensor | None = None) -> tuple[tuple[str, torch.Tensor, int], ...]:
        """(name, tensor, its version counter) of each input tensor (:meth:`named_leaves`; inference tensors keep no
        counter): a forward that writes an input in place moves its counter. Not those in the storage of
        ``apart_from`` (an ``out=`` buffer beside them: views of one tensor share one counter)."""
        shared = None if apart_from is None else apart_from.untyped_storage().data_ptr()
        return tuple((name, t, t._version) for name, t in self.all_named_leaves()
                     if not t.is_inference() and (shared is None or t.untyped_storage().data_ptr() != shared))

    def all_named_leaves(self) -> list[tuple[str, torch.Tensor]]:
        """:meth:`named_leaves` and the tensors inside containers too (``inputs[0]['a']``, ``mask[1]``)."""
        if self.tensor is not None or not any(isinstance(v, list | tuple | dict) for v in self._values()):
            return self.named_leaves()
        named = []
        for path, t in tree_flatten_with_path((self.args, self.kwargs))[0]:
            if isinstance(t, torch.Tensor):
                rest = path[1:]
                named.append((f"inputs{keystr(rest)}" if path[0].idx == 0 else f"{rest[0].key}{keystr(rest[1:])}", t))
        return named

    def _values(self) -> tuple:
        return (*self.args, *self.kwargs.values())

    def sample(self, i: int) -> Batch:
        """Sample i alone, as a batch of one (``t[i:i+1]``)."""
        return self.rows(slice(i, i + 1))

    def __call__(self, model: Callable) -> object:
        args, kwargs = self.args, self.kwargs
        if any(isinstance(v, list | dict) for v in self._values()):  # fresh containers each run: a forward that
            args, kwargs = tree_map(lambda v: v, (args, kwargs))  # rebinds d['a'] leaves the next run's alone
        if self.size == 1 and isinstance(model, torch.nn.Module):  # a batch of one: core/norm_grads.py
            with contiguous_norm_grads(model):
                return model(*args, **kwargs)
        return model(*args, **kwargs)

    def with_leaves(self, leaves: Sequence[torch.Tensor]) -> Batch:
        """The same call with its batched tensors replaced, in :meth:`leaves` order (e.g. one sample under vmap)."""
        t = self.tensor
        if t is not None and not self.shared:
            batched = _is_batched(t, self.size)
            (new,) = leaves if batched else (t,)
            return _one_tensor(new, batched, 1)
        flat, spec = tree_flatten((self.args, self.kwargs))
        batched, it = self._batched(flat), iter(leaves)
        return self._part([next(it) if b else t for t, b in zip(flat, batched, strict=True)], batched, spec, 1)

    def signature(self) -> tuple:
        """What a plan depends on: per value, a batched tensor's shape past B, dtype and device; a shared tensor's
        shape, dtype and device; any other value itself (or its type)."""
        t = self.tensor
        if t is not None and not self.shared:
            batched = _is_batched(t, self.size)
            return _ONE_TENSOR_SPEC, ((batched, tuple(t.shape[1:] if batched else t.shape), t.dtype, t.device),)
        flat, spec = tree_flatten((self.args, self.kwargs))

        def kind(t: object, batched: bool) -> object:
            if isinstance(t, torch.Tensor):
                return (batched, tuple(t.shape[1:] if batched else t.shape), t.dtype, t.device)
            return t if isinstance(t, (bool, int, float, str, type(None))) else type(t)

        return str(spec), tuple(kind(t, b) for t, b in zip(flat, self._batched(flat), strict=True))

    @property
    def device(self) -> torch.device:
        t = self.tensor
        if t is not None:
            return t.device
        return first_tensor((self.args, self.kwargs)).device


def _one_tensor(t: torch.Tensor, batched: bool, size: int) -> Batch:
    """:meth:`Batch._part` of a call ``model(x)`` without the pytree (the fast path): a shared ``t`` stays shared."""
    return Batch((t,), {}, size, frozenset() if batched or not _is_batched(t, size) else frozenset((0,)))


def differs(batch: Batch, i: int, j: int) -> bool:
    """Whether samples i and j differ in any batched tensor."""
    return any(not torch.equal(t[i], t[j]) for t in batch.leaves())


@dataclasses.dataclass
class _Fields:
    """A dataclass output that ``torch.utils._pytree`` does not know, as a pytree (a dict of its fields)."""

    kind: type
    fields: dict


def as_pytree(output: object) -> object:
    """``output`` with a plain dataclass (not a registered pytree node) turned into a dict of its fields."""
    if dataclasses.is_dataclass(output) and not isinstance(output, type) and type(output) not in SUPPORTED_NODES:
        return {"__dataclass__": _Fields(type(output), {}),
                **{f.name: getattr(output, f.name) for f in dataclasses.fields(output)}}
    return output


def from_pytree(output: object) -> object:
    """The inverse of :func:`as_pytree`."""
    if isinstance(output, dict) and isinstance(output.get("__dataclass__"), _Fields):
        fields = {k: v for k, v in output.items() if k != "__dataclass__"}
        return output["__dataclass__"].kind(**fields)
    return output


def normal_tensor(t: object) -> object:
    """``t``, or a normal copy of it if it was created under ``torch.inference_mode()`` (autograd cannot save
    inference tensors for backward); call inside :func:`restoring_modes` (or ``inference_mode(False)``)."""
    if isinstance(t, torch.Tensor) and t.is_inference():
        with torch.inference_mode(False):
            return t.clone()
    return t


def sample_dims(obj: object, size: int) -> object:
    """vmap's ``in_dims`` for ``obj`` (a tensor or a nest): per leaf, 0 where it holds ``size`` samples first (cut),
    None where it is shared (a number, a string, a 0-dim or another tensor: passed whole)."""
    return tree_map(lambda t: 0 if _is_batched(t, size) else None, obj)


def batch_of_one(obj: object, dims: object = 0) -> object:
    """One sample's leaves as ``vmap`` hands them over, as a batch of one: ``dims`` per leaf, as vmap's ``in_dims``
    (0: cut, so unsqueezed; None: passed whole, as it is); one int or None for all."""
    if dims is None or isinstance(dims, int):
        return obj if dims is None else tree_map(lambda t: t.unsqueeze(0) if isinstance(t, torch.Tensor) else t, obj)
    return tree_map(lambda t, d: t.unsqueeze(0) if d == 0 else t, obj, dims)
