"""During the hooked forward, each hooked layer's forward sees the parameters it handles (every registration of them
in its own subtree) as fresh leaves holding the same values. The real parameters are then reached only by a use
outside the layers that handle them: ``self.lin.weight`` read by a parent on a branch the data decides (an outlier
batch), which the probe never saw and the layer rules would miss. The backward asks for every trainable parameter's
gradient (:mod:`~pergrad_viz.engine.unplanned`): none is computed where none is reached, and one that is reached is
refused (``PlanMismatchError``; ``auto`` hands over), on every call, not only when the check is due."""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as module_mod

from pergrad_viz.engine.plan import LayerPlan

Hooked = list[tuple[nn.Module, LayerPlan]]  # the hooked layers: (module, its plan)

Target = tuple[nn.Module, str, nn.Parameter]  # (holder, attribute, the real parameter)


def targets(module: nn.Module, plan: LayerPlan) -> list[Target]:
    """Every registration, in the layer's subtree, of the parameters it handles (kept in its plan)."""
    found = plan.memo.get(_KEY)
    if found is None:
        wanted = {id(module.get_parameter(ln)) for ln in plan.local}
        found = []
        for _, sub in module.named_modules(remove_duplicate=False):
            for attribute, p in sub._parameters.items():
                if p is not None and id(p) in wanted and (sub, attribute, p) not in found:
                    found.append((sub, attribute, p))
        plan.memo[_KEY] = found
    return found


_KEY = "own parameters"  # beside derived.bookkeeping's routes in LayerPlan.memo


class OwnParameters:
    """The leaves of one hooked forward: :meth:`enter` as a global forward pre-hook, :meth:`leave` from the layer's
    forward hook; :attr:`kept`: ids of parameters some registration of which could not be replaced
    (a TorchScript module): the backward does not ask for those."""

    def __init__(self, layers: Hooked):
        self.targets = {id(module): targets(module, plan) for module, plan in layers}
        self.active: list[list[Target]] = []
        self.kept: set[int] = set()

    def enter(self, module: nn.Module, args: tuple) -> None:
        found = self.targets.get(id(module))
        if found is None:  # a module no plan layer is: a global pre-hook sees every module's call
            return
        swapped = []
        for holder, attribute, real in found:
            if holder._parameters.get(attribute) is not real:  # already a leaf (a layer inside another's forward)
                continue
            try:
                holder._parameters[attribute] = real.detach().requires_grad_()
            except (RuntimeError, TypeError, AttributeError):
                self.kept.add(id(real))
                continue
            swapped.append((holder, attribute, real))
        self.active.append(swapped)

    def leave(self) -> None:
        if self.active:
            for holder, attribute, real in self.active.pop():
                holder._parameters[attribute] = real

    def restore(self) -> None:
        """Every real parameter back in place (after an error that skipped a :meth:`leave`)."""
        while self.active:
            self.leave()

    def install(self) -> list:
        """One global forward pre-hook for the pass (one registration, not one per layer), run before every
        module's own pre-hooks (the layer's own see the leaves too); the capture's forward hook calls :meth:`leave`
        (and :meth:`restore` runs after the pass, also on error)."""
        return [module_mod.register_module_forward_pre_hook(self.enter)]
