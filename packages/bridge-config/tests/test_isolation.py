"""bridge-config stands alone: no megatron-core (not even torch) and a light import."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]


def test_declared_dependencies_are_only_core_utils_pyyaml_omegaconf() -> None:
    project = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]
    names = sorted(
        req.split("=")[0].split(">")[0].split("<")[0].strip() for req in project["dependencies"]
    )
    assert names == ["core-utils", "omegaconf", "pyyaml"]


# Runs in a fresh interpreter so that sys.modules shows exactly what bridge.config loads.
FULL_USE = """
import os, sys, tempfile
from dataclasses import dataclass
import bridge.config as bc
assert "torch" not in sys.modules and "omegaconf" not in sys.modules, "import bridge.config stays light"


@dataclass
class Model:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    seq_length: int = 32
    params_dtype: str = "float32"
    bf16: bool = False
    fp16: bool = False


@dataclass
class Optimizer:
    optimizer: str = "adam"
    lr: float = 1e-3
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False
    bf16: bool = False
    fp16: bool = False


flags = dict(reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
cfg = bc.ConfigContainer(
    train=bc.TrainingConfig(micro_batch_size=2, train_iters=10),
    model=Model(),
    optimizer=Optimizer(),
    scheduler=bc.SchedulerConfig(),
    dataset=bc.MockGPTDatasetConfig(random_seed=1, sequence_length=32, **flags),
    logger=bc.LoggerConfig(),
    checkpoint=bc.CheckpointConfig(),
)
cfg = bc.apply_overrides(cfg, ["train.train_iters=20", "ft.enable_ft_package=true", "checkpoint.save=/tmp/c"])
cfg.validate(world_size=2)
path = os.path.join(tempfile.mkdtemp(), "c.yaml")
cfg.to_yaml(path)
loaded = bc.ConfigContainer.from_yaml(path)
loaded.validate(world_size=2)  # values validate() filled in are saved unset
assert loaded == cfg
assert bc.load_config(path, ["optimizer.lr=0.1", "dataset.random_seed=${train.train_iters}"]).optimizer.lr == 0.1
bc.format_diff(cfg.diff_from_defaults())
heavy = ("megatron", "torch", "transformer_engine", "apex", "nvidia_resiliency_ext", "wandb", "mlflow")
loaded = sorted({m.split(".")[0] for m in sys.modules} & set(heavy))
assert not loaded, loaded
"""


def test_full_use_imports_neither_megatron_nor_torch() -> None:
    """Build, validate, override, save and load without loading megatron-core or torch."""
    subprocess.run([sys.executable, "-c", FULL_USE], check=True, timeout=180)
