"""What the trainer measures: FLOPs, parameter and gradient norms, reductions across model
parallel groups, and the JSON-lines metrics file."""

from bridge.train.metrics.flops import num_floating_point_operations
from bridge.train.metrics.metrics_file import JsonlMetricWriter, read_metrics_file
from bridge.train.metrics.norms import (
    calc_dtensor_params_l2_norm,
    calc_params_l2_norm,
    param_is_not_shared,
)
from bridge.train.metrics.reductions import (
    logical_and_across_model_parallel_group,
    reduce_max_stat_across_model_parallel_group,
)

__all__ = [
    "JsonlMetricWriter",
    "calc_dtensor_params_l2_norm",
    "calc_params_l2_norm",
    "logical_and_across_model_parallel_group",
    "num_floating_point_operations",
    "param_is_not_shared",
    "read_metrics_file",
    "reduce_max_stat_across_model_parallel_group",
]
