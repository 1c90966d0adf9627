"""``python -m bridge.train.generate``: the ``bridge-generate`` command."""

from bridge.train.generate.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
