"""bridge.train."""

__all__: list[str] = []
