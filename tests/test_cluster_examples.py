"""The cluster examples hold only what their schedulers and bridge-train accept.

* examples/k8s: every field of every manifest is one that Kubeflow Trainer's API
  (``trainer.kubeflow.org/v1alpha1``, the models of the ``kubeflow-trainer-api`` package,
  generated from Trainer's OpenAPI spec) knows, with a value of its type: a manifest loaded
  into the models and written back is unchanged (the models drop unknown fields and
  refuse wrong types); the TrainJob names the runtime beside it, and its ``bridge-train``
  arguments parse and its overrides load into the recipe.
* examples/slurm: the batch scripts are valid bash, and their ``#SBATCH`` lines carry the
  signal and requeue options the docs describe (tests/test_slurm.py submits them to a real
  SLURM).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubeflow_trainer_api.models import (  # type: ignore[import-untyped]
    TrainerV1alpha1TrainingRuntime,
    TrainerV1alpha1TrainJob,
)

from bridge.config import load_config
from bridge.train.cli import build_parser
from bridge.train.recipes import recipe_path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MODELS: dict[str, Any] = {
    "TrainJob": TrainerV1alpha1TrainJob,
    "TrainingRuntime": TrainerV1alpha1TrainingRuntime,
}


def manifests() -> list[tuple[Path, dict[str, Any]]]:
    found: list[tuple[Path, dict[str, Any]]] = []
    for path in sorted((EXAMPLES / "k8s").glob("*.yaml")):
        found.extend((path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc)
    return found


def round_trip(doc: dict[str, Any]) -> dict[str, Any]:
    model = MODELS[doc["kind"]].from_dict(doc)
    assert model is not None
    result: dict[str, Any] = model.to_dict()
    return result


def test_every_manifest_field_is_in_kubeflow_trainers_api() -> None:
    docs = manifests()
    assert sorted(doc["kind"] for _, doc in docs) == ["TrainJob", "TrainingRuntime"]
    for path, doc in docs:
        assert doc["apiVersion"] == "trainer.kubeflow.org/v1alpha1", path
        assert round_trip(doc) == doc, path


def test_the_check_catches_an_unknown_field_and_a_wrong_type() -> None:
    (_, job) = next((p, d) for p, d in manifests() if d["kind"] == "TrainJob")
    unknown = {**job, "spec": {**job["spec"], "numGPUs": 8}}
    assert round_trip(unknown) != unknown
    wrong = {**job, "spec": {**job["spec"], "trainer": {**job["spec"]["trainer"], "numNodes": "2"}}}
    with pytest.raises(ValueError, match=r"numNodes|num_nodes"):
        round_trip(wrong)


def test_the_trainjob_runs_bridge_train_on_the_runtime_beside_it() -> None:
    docs = {doc["kind"]: doc for _, doc in manifests()}
    job, runtime = docs["TrainJob"], docs["TrainingRuntime"]
    assert job["spec"]["runtimeRef"] == {
        "name": runtime["metadata"]["name"],
        "kind": "TrainingRuntime",
    }
    pod = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"][
        "spec"
    ]
    trainer = job["spec"]["trainer"]
    assert trainer["command"] == ["torchrun"]
    args = trainer["args"]
    shutdown = int(args[0].removeprefix("--shutdown-timeout="))
    assert shutdown < pod["terminationGracePeriodSeconds"]
    assert args[1:3] == ["-m", "bridge.train"]
    parsed = build_parser().parse_intermixed_args(args[3:])
    assert parsed.requeue_exit_code == 75 and parsed.recipe == "tiny_gpt"
    config = load_config(recipe_path(parsed.recipe), parsed.overrides)
    assert config.train is not None and config.train.exit_signal_handler is True
    mount = pod["containers"][0]["volumeMounts"][0]["mountPath"]
    assert config.checkpoint is not None
    assert str(config.checkpoint.save).startswith(mount + "/")


@pytest.mark.parametrize("name", ["pretrain.sbatch", "finetune.sbatch", "srun_requeueable.sh"])
def test_slurm_scripts_are_valid_bash(name: str) -> None:
    subprocess.run(["bash", "-n", str(EXAMPLES / "slurm" / name)], check=True)


@pytest.mark.parametrize("name", ["pretrain.sbatch", "finetune.sbatch"])
def test_batch_scripts_ask_for_the_signal_and_the_requeue(name: str) -> None:
    text = (EXAMPLES / "slurm" / name).read_text()
    options = re.findall(r"^#SBATCH (\S+)", text, flags=re.MULTILINE)
    assert "--signal=B:USR1@300" in options and "--requeue" in options
    assert "--open-mode=append" in options  # a requeued job appends to its output
    assert "train.exit_signal_handler=true train.exit_signal=10" in text  # 10: SIGUSR1
    assert "srun_requeueable" in text and '--requeue-exit-code="$BRIDGE_REQUEUE_EXIT_CODE"' in text
