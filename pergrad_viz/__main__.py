"""``python -m pergrad_viz bench|scan|scan-bench ...``: see :mod:`pergrad_viz.cli.main`."""

import sys

from pergrad_viz.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
