"""CommOverlapConfig: layout choices written into the sections, explicit values, conflicts."""

from __future__ import annotations

import pytest

from bridge.config import ConfigError, DistributedDataParallelConfig
from bridge.train.engine.comm_overlap import CommOverlapConfig
from bridge.train.testing import (
    tiny_config_container,
    tiny_gpt_provider,
    tiny_optimizer_config,
    tiny_train_config,
)


def _container(overlap: CommOverlapConfig, *, dist_opt: bool = False, **model: object):
    return tiny_config_container(
        train=tiny_train_config(),
        model=tiny_gpt_provider(**model),
        optimizer=tiny_optimizer_config(use_distributed_optimizer=dist_opt),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=dist_opt),
        comm_overlap=overlap,
    )


def test_distributed_optimizer_over_two_replicas_gets_overlapped_reduce_and_gather() -> None:
    cfg = _container(CommOverlapConfig(), dist_opt=True)
    cfg.validate(world_size=2)
    assert cfg.ddp.overlap_grad_reduce and cfg.ddp.overlap_param_gather
    assert cfg.ddp.bucket_size == 128 * 1024 * 1024
    assert not cfg.ddp.align_param_gather  # no virtual pipeline


def test_one_replica_or_no_distributed_optimizer_leaves_data_parallel_overlap_off() -> None:
    for world, dist_opt in ((1, True), (2, False)):
        cfg = _container(CommOverlapConfig(), dist_opt=dist_opt)
        cfg.validate(world_size=world)
        assert not cfg.ddp.overlap_grad_reduce and not cfg.ddp.overlap_param_gather
        assert cfg.ddp.bucket_size is None


def test_pipeline_p2p_mode_follows_the_virtual_pipeline() -> None:
    plain = _container(CommOverlapConfig(), pipeline_model_parallel_size=2, num_layers=4)
    plain.validate(world_size=2)
    assert plain.model.batch_p2p_comm and not plain.model.overlap_p2p_comm
    # PP=2 with a virtual pipeline and batched p2p is the combination megatron runs wrongly;
    # the layout choice is the overlapped, unbatched mode.
    virtual = _container(
        CommOverlapConfig(),
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        num_layers=4,
    )
    virtual.validate(world_size=2)
    assert virtual.model.overlap_p2p_comm and not virtual.model.batch_p2p_comm


def test_explicit_fields_win_over_the_layout_choice() -> None:
    cfg = _container(CommOverlapConfig(overlap_param_gather=False, bucket_size=4096), dist_opt=True)
    cfg.validate(world_size=2)
    assert cfg.ddp.overlap_grad_reduce and not cfg.ddp.overlap_param_gather
    assert cfg.ddp.bucket_size == 4096


def test_a_value_the_user_set_in_the_section_is_kept() -> None:
    cfg = _container(CommOverlapConfig(), dist_opt=True)
    cfg.ddp.bucket_size = 1000
    cfg.validate(world_size=2)
    assert cfg.ddp.bucket_size == 1000 and cfg.ddp.overlap_grad_reduce


def test_an_explicit_field_contradicting_the_section_is_refused_naming_both() -> None:
    cfg = _container(CommOverlapConfig(bucket_size=4096), dist_opt=True)
    cfg.ddp.bucket_size = 1000
    with pytest.raises(
        ConfigError, match=r"comm_overlap\.bucket_size: got 4096 but ddp\.bucket_size is 1000"
    ):
        cfg.validate(world_size=2)


def test_settings_that_cannot_act_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"comm_overlap\.tp_comm_overlap: got true"):
        CommOverlapConfig(tp_comm_overlap=True)
    with pytest.raises(ConfigError, match=r"comm_overlap\.bucket_size"):
        CommOverlapConfig(bucket_size=0)
    with pytest.raises(ConfigError, match=r"comm_overlap\.wgrad_deferral_limit: got -1"):
        CommOverlapConfig(wgrad_deferral_limit=-1)
    # A field given here whose section is absent is refused, not dropped.
    with pytest.raises(ConfigError, match=r"overlap_grad_reduce: got True but the ddp section"):
        CommOverlapConfig(overlap_grad_reduce=True).setup(None, None, None)
    cfg = _container(CommOverlapConfig(overlap_param_gather=True))
    with pytest.raises(ConfigError, match=r"comm_overlap\.overlap_param_gather: .*distributed"):
        cfg.validate(world_size=2)


def test_validate_twice_gives_the_same_sections() -> None:
    cfg = _container(CommOverlapConfig(), dist_opt=True)
    cfg.validate(world_size=2)
    first = (cfg.ddp.overlap_grad_reduce, cfg.ddp.overlap_param_gather, cfg.ddp.bucket_size)
    cfg.validate(world_size=2)
    assert (cfg.ddp.overlap_grad_reduce, cfg.ddp.overlap_param_gather, cfg.ddp.bucket_size) == first
