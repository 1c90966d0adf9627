"""bridge.config."""

__all__: list[str] = []
