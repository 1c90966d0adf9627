"""``python -m bridge.train``: the ``bridge-train`` command (see :mod:`bridge.train.cli`)."""

from bridge.train.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
