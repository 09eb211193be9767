"""The bundled Fashion-MNIST sample: the first 1,000 training and 1,000 test images, shipped with the package.

The four uncompressed IDX files live in ``FashionMNIST/raw/`` next to this file (package data, installed by
``pip install``), where ``torchvision.datasets.FashionMNIST(root=ROOT)`` reads them; README.md here tells where
they come from and their licence (MIT, Zalando SE). ``python -m pergrad_viz.tutorial.sample.make_sample`` rebuilds them
from Debian's ``dataset-fashion-mnist`` package. Load them with :func:`pergrad_viz.tutorial.data.load_sample`.
"""

from pathlib import Path

ROOT: Path = Path(__file__).resolve().parent
"""The sample's dataset root: ``ROOT/FashionMNIST/raw/`` holds the IDX files."""
