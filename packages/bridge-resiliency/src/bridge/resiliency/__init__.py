"""bridge.resiliency."""

__all__: list[str] = []
