"""bridge.logging."""

__all__: list[str] = []
