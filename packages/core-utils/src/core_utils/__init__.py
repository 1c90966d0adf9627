"""Megatron-style core utilities, importable without megatron-core."""

__all__: list[str] = []
