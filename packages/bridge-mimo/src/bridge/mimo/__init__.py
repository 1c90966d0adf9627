"""bridge.mimo."""

__all__: list[str] = []
