"""``python -m bridge.train.convert``: the ``bridge-convert`` command."""

import sys

from bridge.train.convert.cli import main

if __name__ == "__main__":
    sys.exit(main())
