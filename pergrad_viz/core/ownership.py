"""Which module owns a trainable parameter: the one definition, for the probe (which layer handles each
parameter's per-sample gradient), the sketches (one block per owning module) and the norms (parameters tied
between layers).

A module *holds* a parameter when it is one of its own (``module.named_parameters(recurse=False)``); a parameter
held by several modules is *shared* (tied). Names: ``full`` is the name in ``model.named_parameters()``,
``local`` the name inside the module (dotted for a descendant's parameter, e.g. ``out_proj.weight``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

from torch import nn

from pergrad_viz.core.trainable import Trainable

# A use of a parameter noted by the probe: the stack of running module names, innermost last, and the function.
Use = tuple[tuple[str, ...], str]


def holders(modules: Iterable[tuple[str, nn.Module]]) -> dict[int, list[str]]:
    """{id(parameter): the names of the modules holding it as their own}, in ``named_modules()`` order."""
    held: dict[int, list[str]] = {}
    for mname, m in modules:
        for _, p in m.named_parameters(recurse=False, remove_duplicate=False):
            held.setdefault(id(p), []).append(mname)
    return held


def local_name(module: nn.Module, p: nn.Parameter) -> str:
    """``p``'s name inside ``module`` (dotted for a descendant's)."""
    return next(ln for ln, q in module.named_parameters(remove_duplicate=False) if q is p)


def first_owners(trainable: Trainable) -> list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]:
    """Per module that holds trainable parameters, in ``named_modules()`` order: ``(module name, module, [(local
    name, parameter)])``; a shared parameter belongs to its first holder only (as in ``named_parameters()``)."""
    full = {id(p) for p in trainable.params}
    taken: set[int] = set()
    owners = []
    for mname, module in trainable.modules:
        own = [(ln, p) for ln, p in module.named_parameters(recurse=False) if id(p) in full and id(p) not in taken]
        if own:
            taken.update(id(p) for _, p in own)
            owners.append((mname, module, own))
    return owners


def tied(handled: Iterable[Mapping[str, str]]) -> set[str]:
    """The full names that more than one layer handles (tied weights), from each layer's {local name: full name}."""
    count = Counter(name for local in handled for name in local.values())
    return {name for name, n in count.items() if n > 1}


def common_prefix(stacks: Sequence[tuple[str, ...]]) -> tuple[str, ...]:
    """The longest common prefix of module stacks (outermost first)."""
    prefix = stacks[0]
    for s in stacks[1:]:
        n = 0
        while n < min(len(prefix), len(s)) and prefix[n] == s[n]:
            n += 1
        prefix = prefix[:n]
    return prefix


def assign(trainable: Trainable, uses: Mapping[str, list[Use]], why_not: Callable[[str], str | None]
           ) -> tuple[dict[str, dict[str, str]], str | None]:
    """Which module handles each trainable parameter: {module name: {local name: full name}}, or a problem.

    ``uses``: per full name, where the forward used the parameter (a parameter never used gets no handler: its
    gradient is zero); ``why_not(module name)``: why that module cannot handle parameters (its tensors do not keep
    the samples apart), or None. The holders themselves where every use is inside one of them (tied: several);
    else the deepest module whose forward contains every use, that holds the parameter and keeps the samples apart
    (e.g. a Linear holding a weight-norm parametrization, not the parametrization itself).
    """
    modules = dict(trainable.modules)
    params = dict(zip(trainable.names, trainable.params, strict=True))
    owners = holders(trainable.modules)
    handlers: dict[str, dict[str, str]] = {}
    for full in trainable.names:
        p = params[full]
        used = uses.get(full)
        if not used:  # never used by the forward: its gradient is zero
            continue
        stacks = [s for s, _func in used]
        innermost = {s[-1] if s else None for s in stacks}
        own = owners.get(id(p), [])
        nested = any(u in s[:-1] for s in stacks for u in innermost)  # a holder's use inside another's forward
        if None not in innermost and not nested and all(u in own and why_not(u) is None for u in innermost):
            chosen = sorted(innermost, key=list(modules).index)  # the owners themselves (tied: several)
        else:
            prefix = common_prefix(stacks)
            holding = [m for m in prefix if any(q is p for q in modules[m].parameters())]
            usable = [m for m in holding if why_not(m) is None]
            handler = usable[-1] if usable else None
            if handler is None or (handler == "" and "" not in own):
                inner = [u for u in innermost if u is not None and u in own and why_not(u) is not None]
                if inner:
                    return {}, why_not(inner[0])
                func = next((f for s, f in used if not s or s[-1] not in own), used[0][1])
                return {}, (f"parameter '{full}' is used outside the forward of its own layer (by {func} in the "
                            "model's forward, e.g. weights tied with F.linear(h, self.emb.weight), or in a forward "
                            "pre-hook: torch.nn.utils.prune, the old weight_norm), so a per-layer rule would miss "
                            "that part of the gradient")
            chosen = [handler]
        for h in chosen:
            handlers.setdefault(h, {})[local_name(modules[h], p)] = full
    return handlers, None
