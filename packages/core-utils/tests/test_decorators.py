"""divide/ensure_divisibility, the lifecycle decorators and the experimental switch."""

from __future__ import annotations

import warnings

import pytest

import core_utils
from core_utils import ExperimentalNotEnabledError


def test_divide_and_ensure_divisibility() -> None:
    assert core_utils.divide(12, 4) == 3
    core_utils.ensure_divisibility(12, 3)
    with pytest.raises(ValueError, match="10 is not divisible by 4"):
        core_utils.divide(10, 4)
    with pytest.raises(ValueError, match="7 is not divisible by 2"):
        core_utils.ensure_divisibility(7, 2)
    with pytest.raises(ValueError, match="cannot divide 5 by 0"):
        core_utils.divide(5, 0)


def test_null_decorator_bare_and_with_arguments() -> None:
    def f() -> int:
        return 1

    assert core_utils.null_decorator(f) is f
    assert core_utils.null_decorator(mode="reduce-overhead")(f) is f
    assert core_utils.null_decorator()(f) is f


def test_deprecated_warns_with_all_details_and_keeps_metadata() -> None:
    @core_utils.deprecated(
        version="1.0.0", removal_version="2.0.0", alternative="new_fn", reason="faster"
    )
    def old_fn(x: int) -> int:
        """Old docstring."""
        return x + 1

    with pytest.warns(DeprecationWarning) as record:
        assert old_fn(1) == 2
    message = str(record[0].message)
    assert "old_fn is deprecated since version 1.0.0" in message
    assert "Use new_fn instead" in message
    assert "removed in version 2.0.0" in message
    assert "Reason: faster" in message
    assert record[0].filename == __file__  # points at the caller
    assert old_fn.__name__ == "old_fn" and old_fn.__doc__ == "Old docstring."
    assert old_fn._deprecated is True  # type: ignore[attr-defined]
    assert old_fn._deprecated_version == "1.0.0"  # type: ignore[attr-defined]
    assert old_fn._removal_version == "2.0.0"  # type: ignore[attr-defined]
    assert old_fn._alternative == "new_fn"  # type: ignore[attr-defined]
    assert old_fn._deprecation_reason == "faster"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="needs a version string"):
        core_utils.deprecated(version="")


def test_deprecated_minimal_message() -> None:
    @core_utils.deprecated("0.3")
    def gone() -> None:
        return None

    with pytest.warns(DeprecationWarning, match=r"^.*gone is deprecated since version 0\.3\.$"):
        gone()


def test_internal_and_experimental_api_markers() -> None:
    @core_utils.internal_api
    def helper() -> int:
        return 3

    @core_utils.experimental_api
    class Thing:
        pass

    assert helper() == 3 and helper._internal_api is True  # type: ignore[attr-defined]
    assert Thing._experimental_api is True  # type: ignore[attr-defined]
    assert isinstance(Thing(), Thing)  # a marker only: no gate


def test_deprecate_inference_params() -> None:
    context, params = object(), object()
    assert core_utils.deprecate_inference_params(context, None) is context
    assert core_utils.deprecate_inference_params(context, params) is context
    with pytest.warns(DeprecationWarning, match="renamed to `inference_context`"):
        assert core_utils.deprecate_inference_params(None, params) is params
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert core_utils.deprecate_inference_params(None, None) is None


@core_utils.experimental_fn(introduced_with_version="0.1.0")
def _experimental_add(a: int, b: int) -> int:
    return a + b


@core_utils.experimental_cls(introduced_with_version="0.1.0")
class _ExperimentalModel:
    def __init__(self, width: int) -> None:
        self.width = width

    @staticmethod
    def build() -> str:
        return "built"

    @classmethod
    def named(cls) -> str:
        return cls.__name__


def test_experimental_calls_fail_without_the_flag(experimental_flag: None) -> None:
    assert core_utils.is_experimental_enabled() is False
    with pytest.raises(ExperimentalNotEnabledError, match=r"_experimental_add is experimental"):
        _experimental_add(1, 2)
    with pytest.raises(ExperimentalNotEnabledError, match="set_experimental_enabled"):
        _ExperimentalModel(3)
    with pytest.raises(ExperimentalNotEnabledError, match="CORE_UTILS_EXPERIMENTAL=1"):
        _ExperimentalModel.build()
    with pytest.raises(ExperimentalNotEnabledError):
        _ExperimentalModel.named()
    assert _ExperimentalModel.is_experimental is False  # type: ignore[attr-defined]


def test_experimental_calls_work_with_the_setter(experimental_flag: None) -> None:
    core_utils.set_experimental_enabled(True)
    assert _experimental_add(1, 2) == 3
    model = _ExperimentalModel(3)
    assert isinstance(model, _ExperimentalModel) and model.width == 3
    assert _ExperimentalModel.build() == "built"
    assert _ExperimentalModel.named() == "_ExperimentalModel"
    assert _ExperimentalModel.is_experimental is True  # type: ignore[attr-defined]
    assert _experimental_add._experimental_api is True  # type: ignore[attr-defined]
    core_utils.set_experimental_enabled(False)
    with pytest.raises(ExperimentalNotEnabledError):
        _experimental_add(1, 2)
    with pytest.raises(TypeError, match="takes a bool"):
        core_utils.set_experimental_enabled("yes")  # type: ignore[arg-type]


def test_experimental_environment_variable(
    experimental_flag: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CORE_UTILS_EXPERIMENTAL", "1")
    assert core_utils.is_experimental_enabled()
    assert _experimental_add(2, 2) == 4
    monkeypatch.setenv("CORE_UTILS_EXPERIMENTAL", "0")
    assert not core_utils.is_experimental_enabled()
    # The setter overrides the environment.
    monkeypatch.setenv("CORE_UTILS_EXPERIMENTAL", "true")
    core_utils.set_experimental_enabled(False)
    assert not core_utils.is_experimental_enabled()


def test_experimental_decorators_validate_the_version() -> None:
    with pytest.raises(ValueError, match=r"experimental_fn\(introduced_with_version='soon'\)"):
        core_utils.experimental_fn("soon")(lambda: None)
    with pytest.raises(ValueError, match="experimental_cls"):
        core_utils.experimental_cls("later")(type("Cls", (), {}))
