"""Version helpers: torch is present; TE, flash-attn, mamba and causal-conv1d are not here."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from packaging.version import Version

import core_utils
import core_utils.versions as versions
from core_utils import MissingPackageError

ABSENT = [
    ("transformer-engine", core_utils.get_te_version, core_utils.is_te_min_version),
    ("flash-attn", core_utils.get_fa_version, core_utils.is_fa_min_version),
    ("mamba-ssm", core_utils.get_mamba_version, core_utils.is_mamba_min_version),
    (
        "causal-conv1d",
        core_utils.get_causal_conv1d_version,
        core_utils.is_causal_conv1d_min_version,
    ),
]


def _installed(package: str) -> bool:
    return versions._installed_version(package) is not None


def test_torch_version_is_cached_and_compares() -> None:
    version = core_utils.get_torch_version()
    assert isinstance(version, Version)
    assert version == Version(torch.__version__)
    assert core_utils.get_torch_version() is version  # cached
    assert core_utils.is_torch_min_version("2.0")
    assert core_utils.is_torch_min_version(version.base_version)
    assert core_utils.is_torch_min_version(str(version), check_equality=True)
    assert not core_utils.is_torch_min_version(str(version), check_equality=False)
    assert not core_utils.is_torch_min_version("999.0")


@pytest.mark.parametrize(("package", "get_version", "is_min_version"), ABSENT)
def test_absent_optional_package(package: str, get_version, is_min_version) -> None:
    if _installed(package):
        pytest.skip(f"{package} is installed in this environment")
    with pytest.raises(MissingPackageError, match=rf"{package} is not installed.*pip install"):
        get_version()
    with pytest.raises(ImportError):  # MissingPackageError is an ImportError
        get_version()
    assert is_min_version("0.0.1") is False
    assert is_min_version("0.0.1", check_equality=False) is False


def test_present_package_version_comes_from_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lookup path for an installed package, exercised with a real distribution."""
    monkeypatch.setitem(
        versions._PACKAGES, "flash-attn", ("packaging", ("packaging",), "packaging")
    )
    versions._installed_version.cache_clear()
    try:
        expected = Version(importlib.metadata.version("packaging"))
        assert core_utils.get_fa_version() == expected
        assert core_utils.is_fa_min_version("1.0")
        assert core_utils.is_fa_min_version(str(expected))
        assert not core_utils.is_fa_min_version(str(expected), check_equality=False)
    finally:
        versions._installed_version.cache_clear()


def test_bad_version_string_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"is_torch_min_version\(version='banana'\)"):
        core_utils.is_torch_min_version("banana")
    with pytest.raises(ValueError, match="not a valid version"):
        core_utils.is_te_min_version("not a version")


def test_mamba_sequence_packing_support(monkeypatch: pytest.MonkeyPatch) -> None:
    installed: dict[str, Version | None] = {"causal-conv1d": None, "mamba-ssm": None}
    monkeypatch.setattr(versions, "_installed_version", lambda package: installed[package])
    assert core_utils.check_mamba_sequence_packing_support() == (
        False,
        "causal_conv1d >= 1.5.3.post1 is required",
    )
    installed["causal-conv1d"] = Version("1.5.3.post1")
    assert core_utils.check_mamba_sequence_packing_support() == (
        False,
        "mamba_ssm >= 2.2.6.post3 is required",
    )
    installed["mamba-ssm"] = Version("2.2.5")
    ok, reason = core_utils.check_mamba_sequence_packing_support(for_inference_not_training=False)
    assert (ok, reason) == (True, None)  # training needs only mamba-ssm >= 2.0.0
    installed["mamba-ssm"] = Version("2.2.6.post3")
    assert core_utils.check_mamba_sequence_packing_support() == (True, None)
