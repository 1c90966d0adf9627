"""Checks a run's config and inputs must pass before anything distributed is built."""

from bridge.train.checks.preflight import check_checkpoint_directories, check_config_before_launch

__all__ = ["check_checkpoint_directories", "check_config_before_launch"]
