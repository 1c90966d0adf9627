"""Checks a run's config and inputs must pass before anything distributed is built.

The modules are imported one by one, not through this package: the command's edge
(``checks.launch``) must stay import-light, and ``checks.preflight`` imports torch.
"""

__all__: list[str] = []
