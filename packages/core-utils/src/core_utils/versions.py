"""Installed-version queries for torch and the optional accelerated packages.

Every ``get_*_version`` returns a :class:`packaging.version.Version` and caches it; it raises
a :class:`MissingPackageError` (an ``ImportError``) naming the package when the package is
not installed. Every ``is_*_min_version`` answers ``False`` for a package that is not
installed, so feature checks need no ``try``. Versions come from the distribution metadata
(no import of the package, which for Transformer Engine or mamba can take seconds and touch
CUDA); a package installed without metadata (e.g. a source checkout on ``sys.path``) is
imported and its ``__version__`` read.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util

import torch
from packaging.version import InvalidVersion, Version

__all__ = [
    "MissingPackageError",
    "check_mamba_sequence_packing_support",
    "get_causal_conv1d_version",
    "get_fa_version",
    "get_mamba_version",
    "get_te_version",
    "get_torch_version",
    "is_causal_conv1d_min_version",
    "is_fa_min_version",
    "is_mamba_min_version",
    "is_te_min_version",
    "is_torch_min_version",
]


class MissingPackageError(ImportError):
    """An optional package whose version was asked for is not installed."""


# (import name, distribution names to try, pip requirement for the message)
_PACKAGES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "transformer-engine": (
        "transformer_engine",
        ("transformer-engine", "transformer_engine", "transformer-engine-torch"),
        "transformer-engine[pytorch]",
    ),
    "flash-attn": ("flash_attn", ("flash-attn", "flash_attn"), "flash-attn"),
    "mamba-ssm": ("mamba_ssm", ("mamba-ssm", "mamba_ssm"), "mamba-ssm"),
    "causal-conv1d": ("causal_conv1d", ("causal-conv1d", "causal_conv1d"), "causal-conv1d"),
}


@functools.cache
def _installed_version(package: str) -> Version | None:
    """The installed version of one of the ``_PACKAGES``, or ``None`` when absent."""
    module_name, dist_names, _ = _PACKAGES[package]
    for dist_name in dist_names:
        try:
            return Version(importlib.metadata.version(dist_name))
        except importlib.metadata.PackageNotFoundError:
            continue
    if importlib.util.find_spec(module_name) is None:
        return None
    module = importlib.import_module(module_name)
    raw = getattr(module, "__version__", None)
    if raw is None:
        return None
    return Version(str(raw))


def _require(package: str, caller: str) -> Version:
    found = _installed_version(package)
    if found is None:
        requirement = _PACKAGES[package][2]
        raise MissingPackageError(
            f"{caller}(): {package} is not installed; install it with "
            f"`pip install {requirement}` or check is_*_min_version() first"
        )
    return found


def _parse(version: str | Version, caller: str) -> Version:
    if isinstance(version, Version):
        return version
    try:
        return Version(str(version))
    except InvalidVersion as exc:
        raise ValueError(
            f"{caller}(version={version!r}): not a valid version string (e.g. '2.1.0')"
        ) from exc


def _at_least(installed: Version | None, version: Version, check_equality: bool) -> bool:
    if installed is None:
        return False
    return installed >= version if check_equality else installed > version


@functools.cache
def get_torch_version() -> Version:
    """Return the installed torch version (cached)."""
    try:
        return Version(str(torch.__version__))
    except InvalidVersion:  # pragma: no cover - exotic local builds
        return Version(importlib.metadata.version("torch"))


def is_torch_min_version(version: str | Version, check_equality: bool = True) -> bool:
    """Return whether torch is at least ``version`` (strictly newer if not ``check_equality``)."""
    wanted = _parse(version, "is_torch_min_version")
    return _at_least(get_torch_version(), wanted, check_equality)


def get_te_version() -> Version:
    """Return the installed Transformer Engine version (cached).

    Raises:
        MissingPackageError: transformer-engine is not installed.
    """
    return _require("transformer-engine", "get_te_version")


def is_te_min_version(version: str | Version, check_equality: bool = True) -> bool:
    """Return whether transformer-engine >= ``version`` is installed (``False`` if absent)."""
    wanted = _parse(version, "is_te_min_version")
    return _at_least(_installed_version("transformer-engine"), wanted, check_equality)


def get_fa_version() -> Version:
    """Return the installed flash-attn version (cached).

    Raises:
        MissingPackageError: flash-attn is not installed.
    """
    return _require("flash-attn", "get_fa_version")


def is_fa_min_version(version: str | Version, check_equality: bool = True) -> bool:
    """Return whether flash-attn >= ``version`` is installed (``False`` if absent)."""
    wanted = _parse(version, "is_fa_min_version")
    return _at_least(_installed_version("flash-attn"), wanted, check_equality)


def get_mamba_version() -> Version:
    """Return the installed mamba-ssm version (cached).

    Raises:
        MissingPackageError: mamba-ssm is not installed.
    """
    return _require("mamba-ssm", "get_mamba_version")


def is_mamba_min_version(version: str | Version, check_equality: bool = True) -> bool:
    """Return whether mamba-ssm >= ``version`` is installed (``False`` if absent)."""
    wanted = _parse(version, "is_mamba_min_version")
    return _at_least(_installed_version("mamba-ssm"), wanted, check_equality)


def get_causal_conv1d_version() -> Version:
    """Return the installed causal-conv1d version (cached).

    Raises:
        MissingPackageError: causal-conv1d is not installed.
    """
    return _require("causal-conv1d", "get_causal_conv1d_version")


def is_causal_conv1d_min_version(version: str | Version, check_equality: bool = True) -> bool:
    """Return whether causal-conv1d >= ``version`` is installed (``False`` if absent)."""
    wanted = _parse(version, "is_causal_conv1d_min_version")
    return _at_least(_installed_version("causal-conv1d"), wanted, check_equality)


# Minimum versions whose kernels accept packed (variable-length) sequences.
_PACKING_MIN_VERSIONS = {
    # inference needs the varlen conv state update and the chunked-prefill scan
    True: {"causal-conv1d": "1.5.3.post1", "mamba-ssm": "2.2.6.post3"},
    False: {"causal-conv1d": "1.4.0", "mamba-ssm": "2.0.0"},
}


def check_mamba_sequence_packing_support(
    for_inference_not_training: bool = True,
) -> tuple[bool, str | None]:
    """Check whether causal-conv1d and mamba-ssm support sequence packing.

    Args:
        for_inference_not_training: Check the (newer) versions inference needs rather than
            the ones training needs.

    Returns:
        ``(True, None)`` when both packages are recent enough, else ``(False, reason)``
        where ``reason`` names the package and the version required.
    """
    minimums = _PACKING_MIN_VERSIONS[bool(for_inference_not_training)]
    conv1d_min, mamba_min = minimums["causal-conv1d"], minimums["mamba-ssm"]
    if not is_causal_conv1d_min_version(conv1d_min):
        return False, f"causal_conv1d >= {conv1d_min} is required"
    if not is_mamba_min_version(mamba_min):
        return False, f"mamba_ssm >= {mamba_min} is required"
    return True, None
