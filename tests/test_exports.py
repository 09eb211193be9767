"""Every exception a user may catch is exported from ``pergrad_viz``: each public exception class defined anywhere in
the package (all modules imported) is ``pv.<Name>`` and in ``pv.__all__``."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import warnings

import pergrad_viz as pv

INTERNAL = {
    "pergrad_viz.explorer.state.Stale",  # the explorer's worker drops a stale job with it; it never leaves the worker
    "pergrad_viz.engine.lowest.StaleLowest",  # book-keeping runs the batch again on it; it never leaves the call
}


def _package_exceptions() -> dict[str, type[BaseException]]:
    found = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for info in pkgutil.walk_packages(pv.__path__, prefix="pergrad_viz."):
            if info.name.endswith("__main__"):
                continue
            module = importlib.import_module(info.name)
            for name, obj in vars(module).items():
                if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name
                        and not name.startswith("_")):
                    found[f"{info.name}.{name}"] = obj
    return found


def test_every_public_exception_is_exported_from_pergrad_viz():
    found = _package_exceptions()
    assert "pergrad_viz.errors.UndefinedPerSampleError" in found and len(found) >= 8
    missing = sorted(path for path, cls in found.items()
                     if path not in INTERNAL and (getattr(pv, cls.__name__, None) is not cls
                                                  or cls.__name__ not in pv.__all__))
    assert not missing, f"not exported from pergrad_viz (add them to __init__.py and __all__): {missing}"


def test_the_exported_exceptions_keep_their_bases():
    assert issubclass(pv.UndefinedPerSampleError, pv.UnsupportedModelError)
    assert issubclass(pv.UnsupportedModelError, ValueError) and issubclass(pv.MemoryBudgetError, MemoryError)
    assert issubclass(pv.MissingExtraError, ImportError)
    for name in ("HandOverError", "CheckFailedError", "PlanMismatchError", "VmapError"):
        assert issubclass(getattr(pv, name), pv.UnsupportedModelError)


def test_dir_lists_the_public_api_not_the_modules_it_imports():
    import pergrad_viz as pv

    names = dir(pv)
    assert set(pv.__all__) <= set(names) and {"widgets", "viz", "__version__"} <= set(names)
    assert "importlib" not in names and "moved" not in names
