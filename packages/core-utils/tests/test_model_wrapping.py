"""Unwrapping models and reading attributes through wrappers."""

from __future__ import annotations

import pytest
import torch

import core_utils


class _Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.config = {"hidden": 2}
        self.model_type = "encoder_or_decoder"
        self.xattn_needed = True


class _Wrapper(torch.nn.Module):
    """A wrapper with a config attribute that is None, like some megatron wrappers."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.config = None


def test_get_attr_wrapped_model_walks_through_wrappers() -> None:
    inner = _Inner()
    wrapped = _Wrapper(_Wrapper(inner))
    assert core_utils.get_model_type(wrapped) == "encoder_or_decoder"
    assert core_utils.get_model_xattn(wrapped) is True
    # allow_none=True stops at the first level that has the attribute, even if None.
    assert core_utils.get_attr_wrapped_model(wrapped, "config") is None
    assert core_utils.get_model_config(wrapped) == {"hidden": 2}
    assert core_utils.get_attr_wrapped_model(wrapped, "linear", return_model_obj=True) is inner
    with pytest.raises(RuntimeError, match=r"no attribute 'missing'.*_Wrapper"):
        core_utils.get_attr_wrapped_model(wrapped, "missing")
    with pytest.raises(RuntimeError, match="got a list of 1"):
        core_utils.get_attr_wrapped_model([wrapped], "config")  # type: ignore[arg-type]
    assert core_utils.get_model_xattn(torch.nn.Linear(1, 1)) is False


def test_unwrap_model_defaults_and_custom_wrappers() -> None:
    inner = _Inner()
    assert core_utils.unwrap_model(inner) is inner
    # A custom wrapper class is stripped only when named.
    wrapped = _Wrapper(inner)
    assert core_utils.unwrap_model(wrapped) is wrapped
    assert core_utils.unwrap_model(wrapped, _Wrapper) is inner
    assert core_utils.unwrap_model([wrapped, inner], (_Wrapper,)) == [inner, inner]


def _wrapper_class(name: str, module: str) -> type:
    def __init__(self: torch.nn.Module, inner: torch.nn.Module) -> None:
        torch.nn.Module.__init__(self)
        self.module = inner

    return type(name, (torch.nn.Module,), {"__init__": __init__, "__module__": module})


@pytest.mark.parametrize(
    ("name", "module"),
    [
        ("Float16Module", "megatron.core.transformer.module"),
        ("DistributedDataParallel", "megatron.core.distributed.distributed_data_parallel"),
        ("TorchFullyShardedDataParallel", "megatron.core.distributed.torch_fsdp"),
        ("FullyShardedDataParallel", "megatron.core.distributed.fsdp.mcore_fsdp_adapter"),
    ],
)
def test_unwrap_model_recognises_megatron_wrappers_by_name(name: str, module: str) -> None:
    """megatron-core's wrappers are matched by module and class name, never imported."""
    wrapper_cls = _wrapper_class(name, module)
    inner = _Inner()
    assert core_utils.unwrap_model(wrapper_cls(wrapper_cls(inner))) is inner
    subclass = type("MyWrapper", (wrapper_cls,), {"__module__": "mypkg"})
    assert core_utils.unwrap_model(subclass(inner)) is inner
    # The same class name outside megatron-core is not stripped.
    lookalike = _wrapper_class(name, "mypkg.wrappers")(inner)
    assert core_utils.unwrap_model(lookalike) is lookalike


class _DDP(torch.nn.parallel.DistributedDataParallel):
    """A torch DDP instance without DDP's constructor (which needs a process group and
    imports torch._dynamo, tens of seconds on a loaded CPU); unwrapping only reads .module."""

    def __init__(self, module: torch.nn.Module) -> None:
        torch.nn.Module.__init__(self)
        self.module = module


def test_unwrap_model_strips_torch_ddp() -> None:
    inner = _Inner()
    ddp = _DDP(_DDP(inner))
    assert core_utils.unwrap_model(ddp) is inner
    assert core_utils.unwrap_model([ddp]) == [inner]
    assert core_utils.get_model_type(ddp) == "encoder_or_decoder"


def test_is_submodule() -> None:
    inner = _Inner()
    outer = _Wrapper(inner)
    assert core_utils.is_submodule(inner.linear, outer)
    assert core_utils.is_submodule(inner, outer)
    assert not core_utils.is_submodule(outer, outer)
    assert core_utils.is_submodule(outer, outer, strict=False)
    assert not core_utils.is_submodule(torch.nn.Linear(1, 1), outer)
