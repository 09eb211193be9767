"""A scan's directory: a JSON manifest, one ``.npy`` file per quantity, one marker file per finished chunk.

Layout of ``DIR``::

    DIR/manifest.json          what was scanned and how (see :func:`new_manifest`), which chunks are done
    DIR/<quantity>.npy         (N, ...) rows in dataset order, NaN until written (numpy .npy, memory-mappable)
    DIR/chunks/<c>.done        written by the process that finished chunk c, after its rows were flushed

Chunk c covers the examples ``[c * chunk_size, min((c + 1) * chunk_size, N))``. The markers are the truth
while a scan runs (any process may finish any chunk); rank 0 copies them into the manifest's
``chunks.done``. Writes of the manifest go through a temporary file and ``os.replace``, so a killed
process never leaves half a manifest.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import types
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

FORMAT = "pergrad_viz.scan/1"
MANIFEST = "manifest.json"
CHUNKS = "chunks"

# The fields of a manifest that must match for a rerun to continue a scan (everything that changes results).
MUST_MATCH = ("fingerprint", "settings", "arrays")


class ScanMismatchError(ValueError):
    """A scan directory holds a different scan (model, dataset or settings) than the one asked for."""


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor's values (any dtype, any shape, any device)."""
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def model_fingerprint(model: nn.Module) -> dict:
    """{"class", "sha256"} of what decides the model's results: its class; every submodule's name, class and
    training flag; every parameter's ``requires_grad``; every parameter and buffer value (non-persistent buffers
    too, which ``state_dict()`` leaves out). Not covered: plain Python attributes of modules (e.g. a custom
    layer's ``self.scale = 2.0``) and the code of ``forward`` (the class's name stands for it)."""
    h = hashlib.sha256(f"{type(model).__module__}.{type(model).__qualname__}".encode())
    parts = {part: hashlib.sha256() for part in ("structure", "training flags", "requires_grad", "values")}

    def add(part: str, data: bytes) -> None:
        h.update(data)
        parts[part].update(data)

    for name, m in model.named_modules():
        add("structure", f"module {name}:{type(m).__module__}.{type(m).__qualname__}".encode())
        add("training flags", f":{m.training}".encode())
    for name, p in model.named_parameters():
        add("requires_grad", f"{name}:{p.requires_grad}".encode())
    for name, t in model.state_dict().items():
        add("values", f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        add("values", _tensor_bytes(t))
    persistent = set(model.state_dict())
    for name, b in model.named_buffers():
        if name not in persistent:  # a non-persistent buffer (e.g. a mask or rotary table computed at init)
            add("values", f"buffer {name}:{tuple(b.shape)}:{b.dtype}".encode())
            add("values", _tensor_bytes(b))
    # each part's own digest, so that a refusal names what changed (a training flag, the weights)
    return {"class": type(model).__qualname__, "sha256": h.hexdigest(),
            "parts": {part: d.hexdigest()[:16] for part, d in parts.items()}}


def _item_bytes(value: object) -> bytes:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)}:{value.dtype}:".encode() + _tensor_bytes(value)
    if isinstance(value, np.ndarray):
        return f"{value.shape}:{value.dtype}:".encode() + np.ascontiguousarray(value).tobytes()
    if isinstance(value, (tuple, list)):
        return b"(" + b",".join(_item_bytes(v) for v in value) + b")"
    if isinstance(value, Mapping):
        return b"{" + b",".join(repr(k).encode() + b":" + _item_bytes(value[k]) for k in sorted(value, key=str)) + b"}"
    return repr(value).encode()


def dataset_fingerprint(dataset: object, n: int, samples: int = 16) -> dict:
    """{"class", "length", "sha256"}: the dataset's type, length and ``samples`` evenly spaced items (the
    first and the last among them). A sampled fingerprint: it catches another dataset, another split,
    another order or transform, not an edit of one item between the sampled ones."""
    h = hashlib.sha256(f"{type(dataset).__qualname__}:{n}".encode())
    for i in sorted({round(k * (n - 1) / max(samples - 1, 1)) for k in range(samples)}):
        h.update(f"{i}:".encode() + _item_bytes(dataset[i]))
    return {"class": type(dataset).__qualname__, "length": n, "sha256": h.hexdigest()}


_SIMPLE = (int, float, complex, str, bytes, bool, type(None))


def _const_bytes(value: object) -> bytes:
    """Bytes for a constant of a code object, the same in every process (frozensets sorted: their iteration
    order follows string hashing, which is randomised per process)."""
    if isinstance(value, types.CodeType):
        return _code_bytes(value)
    if isinstance(value, (frozenset, set)):
        return b"{" + b",".join(sorted(_const_bytes(v) for v in value)) + b"}"
    if isinstance(value, tuple):
        return b"(" + b",".join(_const_bytes(v) for v in value) + b")"
    return repr(value).encode()


def _code_bytes(code: types.CodeType) -> bytes:
    """A code object's bytecode, constants (nested code objects too) and the global / attribute names it uses."""
    return b"|".join([code.co_code, _const_bytes(code.co_consts), repr(code.co_names).encode()])


def _value_bytes(value: object, depth: int) -> bytes:
    """A closure cell's or default argument's value: simple values, tensors and arrays by value, callables by
    :func:`_describe_callable`, anything else by its type only."""
    if isinstance(value, (*_SIMPLE, torch.Tensor, np.ndarray)):
        return _item_bytes(value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, (*_SIMPLE, torch.Tensor, np.ndarray)) for v in value):
        return _item_bytes(value)
    if callable(value) and depth < 3:
        return _describe_callable(value, depth + 1).encode()
    return f"<{type(value).__module__}.{type(value).__qualname__}>".encode()


def _function_description(fn: types.FunctionType, depth: int) -> str:
    h = hashlib.sha256(_code_bytes(fn.__code__))
    for value in (*(fn.__defaults__ or ()), *sorted((fn.__kwdefaults__ or {}).items())):
        h.update(b"default:" + _value_bytes(value, depth))
    for cell in fn.__closure__ or ():
        try:
            h.update(b"cell:" + _value_bytes(cell.cell_contents, depth))
        except ValueError:  # an empty cell (a name assigned after the function was made)
            h.update(b"cell:<empty>")
    return f"{fn.__module__}.{fn.__qualname__}[code {h.hexdigest()[:16]}]"


def _describe_callable(loss_fn: object, depth: int = 0) -> str:
    if isinstance(loss_fn, nn.Module):
        plain = {k: v for k, v in sorted(vars(loss_fn).items())
                 if not k.startswith("_") and k != "training" and isinstance(v, _SIMPLE)}
        tensors = {k: hashlib.sha256(_item_bytes(v)).hexdigest()[:12]
                   for k, v in sorted([*loss_fn._buffers.items(), *loss_fn._parameters.items()]) if v is not None}
        return f"{type(loss_fn).__qualname__}({plain}, {tensors})"
    if isinstance(loss_fn, functools.partial):
        args = hashlib.sha256(b"".join(_value_bytes(v, depth) for v in loss_fn.args)
                              + b"".join(k.encode() + _value_bytes(v, depth)
                                         for k, v in sorted(loss_fn.keywords.items()))).hexdigest()[:12]
        return f"partial({_describe_callable(loss_fn.func, depth + 1)}, args {args})"
    if isinstance(loss_fn, types.FunctionType):
        return _function_description(loss_fn, depth)
    if isinstance(loss_fn, types.MethodType):
        return f"{_describe_callable(loss_fn.__func__, depth + 1)} of {_describe_callable(loss_fn.__self__, depth + 1)}"
    name = getattr(loss_fn, "__qualname__", None)
    if name is not None:  # a builtin function, or a class used as a callable
        return f"{getattr(loss_fn, '__module__', '?')}.{name}"
    state = {k: _value_bytes(v, depth).decode(errors="replace")[:80] for k, v in sorted(vars(loss_fn).items())
             if not k.startswith("_")} if hasattr(loss_fn, "__dict__") else {}
    return f"{type(loss_fn).__module__}.{type(loss_fn).__qualname__}({state})"


def loss_description(loss_fn: object) -> str:
    """A stable text for the loss, the same in every process, so that a rerun with another loss is refused.

    Covered: for an ``nn.Module`` loss its type, plain settings (``reduction``, ``label_smoothing``,
    ``ignore_index``, ...) and tensor buffers (``weight``, ``pos_weight``); for a plain function or lambda its
    module and name plus a hash of its bytecode, constants, the global and attribute names it uses, its default
    arguments and the values in its closure (numbers, strings, tensors, arrays, nested callables; other objects by
    type); for ``functools.partial`` the function and its arguments; for a bound method the function and its
    object. Not covered: the values of globals a function reads (``lambda o, t: F.cross_entropy(o, t, weight=W)``
    with a module-level ``W`` changed in place) and the code of a custom loss class's ``forward``."""
    return _describe_callable(loss_fn)


def chunk_count(n: int, chunk_size: int) -> int:
    return math.ceil(n / chunk_size)


def new_manifest(model: nn.Module, loss_fn: object, dataset: object, n: int, *, quantities: list[str],
                 dtype: torch.dtype, layers: list[str], proj_dim: int | None, seed: int, chunk_size: int,
                 projection: list[dict] | None) -> dict:
    """The manifest of a scan about to start: what is scanned (fingerprints), how (settings), the arrays' files,
    shapes and dtypes, the chunks (none done yet) and the runs (none yet). ``layers`` names the ``layer_norms``
    columns; ``projection`` describes the gradient sketch (None without one)."""
    np_dtype = np.dtype(str(dtype).removeprefix("torch."))
    widths = {"layer_norms": (len(layers),), "projection": (proj_dim,)}
    arrays = {q: {"file": f"{q}.npy", "shape": [n, *widths.get(q, ())], "dtype": np_dtype.str} for q in quantities}
    return {
        "format": FORMAT,
        "fingerprint": {"model": model_fingerprint(model), "dataset": dataset_fingerprint(dataset, n)},
        "settings": {
            "quantities": quantities,
            "loss": loss_description(loss_fn),
            "dtype": str(dtype),
            "chunk_size": chunk_size,
            "proj_dim": proj_dim,
            "seed": seed if projection is not None else None,  # only the projection is random
            "layers": layers,
            "projection": projection,
        },
        "arrays": arrays,
        "chunks": {"size": chunk_size, "count": chunk_count(n, chunk_size), "done": []},
        "complete": False,
        "runs": [],
    }


def manifest_path(out: Path) -> Path:
    return out / MANIFEST


def read_manifest(out: Path) -> dict:
    """The manifest of the scan in ``out``; clear errors for a missing or foreign directory."""
    path = manifest_path(out)
    if not out.exists():
        raise FileNotFoundError(f"no scan at {out}: the directory does not exist. Run pv.scan(..., out={str(out)!r}) "
                                "(or `python -m pergrad_viz scan --out ...`) first")
    if not path.is_file():
        raise FileNotFoundError(f"{out} is not a pergrad_viz scan: it has no {MANIFEST}. Pass the directory a scan "
                                "wrote (pv.scan(..., out=DIR))")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} cannot be read as JSON ({exc}); it is damaged: delete {out} and scan again") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ValueError(f"{path} is not a pergrad_viz scan manifest (format {found!r}, expected {FORMAT!r}); "
                         "pass a directory written by pv.scan, or delete it and scan again")
    return manifest


def write_manifest(out: Path, manifest: Mapping) -> None:
    """Atomically replace ``out/manifest.json``."""
    path = manifest_path(out)
    tmp = path.with_name(f".{MANIFEST}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


def refresh_manifest(out: Path, manifest: dict) -> None:
    """Copy the chunk markers into ``manifest`` (``chunks.done``, ``complete``) and write it."""
    manifest["chunks"]["done"] = sorted(set(manifest["chunks"]["done"]) | done_chunks(out))
    manifest["complete"] = len(manifest["chunks"]["done"]) == manifest["chunks"]["count"]
    write_manifest(out, manifest)


# what a changed fingerprint means, said instead of its hashes
_CHANGED = {"fingerprint.model.parts.structure": "the model's layers (other modules, names or classes)",
            "fingerprint.model.parts.values": "the model's parameters or buffers (other values: another checkpoint, "
                                              "seed or training; or other shapes: another width)",
            "fingerprint.model.parts.training flags": "the model's training flags (train() / eval())",
            "fingerprint.model.parts.requires_grad": "which of the model's parameters are trainable",
            "fingerprint.dataset.sha256": "the dataset (other examples, split or limit)"}


def differences(old: Mapping, new: Mapping) -> list[str]:
    """Human-readable differences between two manifests in the fields that must match: what a changed fingerprint
    means (not its hashes), other values shortened."""
    diffs = []
    parts_differ = old.get("fingerprint", {}).get("model", {}).get("parts") != \
        new.get("fingerprint", {}).get("model", {}).get("parts")

    def walk(a: object, b: object, where: str) -> None:
        if where == "fingerprint.model.parts" and (a is None or b is None):  # a scan begun before parts were kept
            return
        if where == "fingerprint.model.sha256" and parts_differ:  # the parts say which
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=str):
                walk(a.get(k), b.get(k), f"{where}.{k}" if where else str(k))
        elif a != b:
            if where in _CHANGED:
                diffs.append(f"{_CHANGED[where]} changed")
                return
            why = " (chunk_size defaults to a multiple of batch_size: pass the batch_size the scan began with, or "\
                  "its chunk_size)" if where == "settings.chunk_size" else ""
            diffs.append(f"{where}: {_short(a)} in the directory, {_short(b)} now{why}")

    for field in MUST_MATCH:
        walk(old.get(field), new.get(field), field)
    return diffs


def _short(value: object, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def check_same_scan(out: Path, old: Mapping, new: Mapping) -> None:
    """Refuse to continue a scan with a different model, dataset or settings."""
    diffs = differences(old, new)
    if diffs:
        shown = "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
        raise ScanMismatchError(
            f"{out} holds a different scan ({shown}). Results would be mixed, so nothing was done. To fix: pass a "
            f"new out= directory, delete {out} to start over, or rerun with the model, dataset and settings it was "
            "started with"
        )


def create_arrays(out: Path, arrays: Mapping[str, Mapping]) -> None:
    """One NaN-filled ``.npy`` per quantity, shapes and dtypes from the manifest's ``arrays``."""
    for spec in arrays.values():
        mm = np.lib.format.open_memmap(out / spec["file"], mode="w+", dtype=np.dtype(spec["dtype"]),
                                       shape=tuple(spec["shape"]))
        mm[...] = np.nan
        mm.flush()
        del mm


def open_arrays(out: Path, arrays: Mapping[str, Mapping], mode: str = "r+") -> dict[str, np.memmap]:
    """The quantities' ``.npy`` files memory-mapped (checked against the manifest)."""
    result = {}
    for q, spec in arrays.items():
        path = out / spec["file"]
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing from the scan in {out}: delete {out} and scan again")
        mm = np.load(path, mmap_mode=mode)
        if tuple(mm.shape) != tuple(spec["shape"]) or mm.dtype != np.dtype(spec["dtype"]):
            raise ValueError(f"{path} holds {mm.dtype} {tuple(mm.shape)}, the manifest says {spec['dtype']} "
                             f"{tuple(spec['shape'])}: the scan in {out} is damaged; delete it and scan again")
        result[q] = mm
    return result


def remove_unstarted(out: Path, manifest: Mapping, existed: bool) -> None:
    """Take away what a scan that finished no chunk wrote into ``out`` (its manifest, its arrays, ``out`` itself where
    the scan created it): a retry with other settings then starts afresh instead of meeting this scan's manifest."""
    if done_chunks(out):
        return
    for spec in manifest["arrays"].values():
        (out / spec["file"]).unlink(missing_ok=True)
    manifest_path(out).unlink(missing_ok=True)
    if (out / CHUNKS).is_dir() and not any((out / CHUNKS).iterdir()):
        (out / CHUNKS).rmdir()
    if not existed and not any(out.iterdir()):
        out.rmdir()


def done_chunks(out: Path) -> set[int]:
    """Chunks whose marker file exists."""
    folder = out / CHUNKS
    if not folder.is_dir():
        return set()
    return {int(p.stem) for p in folder.glob("*.done") if p.stem.isdigit()}


def mark_done(out: Path, chunk: int) -> None:
    folder = out / CHUNKS
    folder.mkdir(exist_ok=True)
    tmp = folder / f".{chunk:07d}.{os.getpid()}.tmp"
    tmp.write_bytes(b"")
    os.replace(tmp, folder / f"{chunk:07d}.done")
