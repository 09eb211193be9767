"""Numbers as people pass them (issue 28): what comes out of numpy, a config file or a tensor's reduction is a
number wherever the package asks for one; what is not finite, or not a real scalar, is refused.

``REALS``: (label, maker of a value equal to the given float); ``COUNTS``: (label, maker of a value equal to the
given int); ``NOT_NUMBERS``: (label, value) refused everywhere a number is asked.
"""

from __future__ import annotations

import numpy as np
import torch

REALS = [
    ("float", float),
    ("int", lambda v: int(v) if float(v).is_integer() else v),
    ("np.float32", np.float32),
    ("np.float64", np.float64),
    ("np.float16", np.float16),
    ("np.int64", lambda v: np.int64(v) if float(v).is_integer() else np.float64(v)),
    ("0-dim float tensor", lambda v: torch.tensor(v)),
    ("0-dim float64 tensor", lambda v: torch.tensor(v, dtype=torch.float64)),
    ("0-dim numpy array", lambda v: np.array(v)),
    ("tensor.max() of norms", lambda v: torch.tensor([v / 2, v]).max()),
]
COUNTS = [
    ("int", int),
    ("np.int64", np.int64),
    ("np.int32", np.int32),
    ("0-dim long tensor", lambda v: torch.tensor(v)),
]
NON_FINITE = [
    ("nan", float("nan")),
    ("inf", float("inf")),
    ("np.float32 nan", np.float32("nan")),
    ("tensor inf", torch.tensor(float("inf"))),
    ("np.float64 -inf", np.float64("-inf")),
]
NOT_NUMBERS = [
    ("bool", True),
    ("np.bool_", np.bool_(True)),
    ("a (2,) tensor", torch.tensor([0.5, 1.0])),
    ("a (1,) tensor", torch.tensor([0.5])),
    ("complex", 0.5 + 0j),
    ("string", "0.5"),
    ("None", None),
]
