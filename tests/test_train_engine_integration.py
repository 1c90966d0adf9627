"""End to end over the engine seam: preprocess a corpus with the command line, write a YAML
config with bridge.config, train it under torchrun with 2 data-parallel ranks and launched
bare on one process, and check both runs see the same losses and read the corpus' tokens
(megatron-core's engine; on CPU under ``core_utils.cuda_emulation``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bridge.config import (
    CheckpointConfig,
    ConfigContainer,
    GPTDatasetConfig,
    LoggerConfig,
    TokenizerConfig,
)
from bridge.train.testing import (
    tiny_dist_config,
    tiny_gpt_provider,
    tiny_optimizer_config,
    tiny_scheduler_config,
    tiny_train_config,
)
from core_utils.testing import run_torchrun

DOCUMENTS = [
    "alpha beta gamma",
    "one engine trains on CPU and GPU",
    "megatron-core builds the model",
    "hi",
    "data parallel ranks share one sample order",
]

# Run by torchrun (2 ranks) and directly (1 rank): everything comes from the YAML config.
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from bridge.config import ConfigContainer
    from bridge.train import GlobalState
    from bridge.train.loop.bare_loop import train_steps
    from bridge.train.data import (
        build_tokenizer, build_train_valid_test_data_iterators, build_train_valid_test_datasets,
        train_valid_test_num_samples,
    )
    from bridge.train.engine import build_engine

    def main() -> None:
        config_path, out_path = sys.argv[1], sys.argv[2]
        cfg = ConfigContainer.from_yaml(config_path)
        engine = build_engine()
        engine.initialize_distributed(cfg.model, cfg.dist, cfg.rng)
        cfg.validate(world_size=torch.distributed.get_world_size())
        tokenizer = build_tokenizer(cfg.tokenizer)
        cfg.model.apply_tokenizer(tokenizer)
        model = engine.setup_model(cfg.model, cfg.ddp)
        optimizer, scheduler = engine.setup_optimizer(model, cfg.optimizer, cfg.scheduler, cfg.train)
        datasets = build_train_valid_test_datasets(cfg.dataset, tokenizer, train_valid_test_num_samples(cfg.train))
        state = GlobalState(cfg=cfg)
        train_it, _, _ = build_train_valid_test_data_iterators(datasets, cfg.dataset, cfg.train, state.train_state)
        first = next(iter(datasets[0]))["tokens"].tolist()
        result = train_steps(
            engine, model, optimizer, scheduler, train_it,
            train_iters=cfg.train.train_iters, global_batch_size=cfg.train.global_batch_size,
            micro_batch_size=cfg.train.micro_batch_size, seq_length=cfg.model.seq_length,
            train_state=state.train_state,
        )
        rank = torch.distributed.get_rank()
        with open(f"{out_path}.{rank}", "w") as f:
            json.dump({"losses": result.losses, "first": first, "eod": tokenizer.eod,
                       "world": torch.distributed.get_world_size(),
                       "consumed": state.train_state.consumed_train_samples}, f)

    if __name__ == "__main__":
        main()
    """
)


def _run_bare(script: Path, config_path: Path, out: Path) -> None:
    """Run the script as ``python train_script.py`` (no torchrun environment).

    A fresh interpreter rather than a fork of this one: a fork of a process whose OpenMP
    pool already ran (earlier tests here trained models) can deadlock in the child. Without
    WORLD_SIZE / MASTER_ADDR the trainer creates its own one-rank group.
    """
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    try:
        done = subprocess.run(
            [sys.executable, str(script), str(config_path), str(out)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the bare single-process run did not finish within 300 s")
    assert done.returncode == 0, f"the bare run exited with {done.returncode}:\n{done.stderr}"


_LAUNCHER_VARIABLES = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_preprocess_cli_then_train_from_yaml_with_two_ranks_and_bare(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"body": d}) + "\n" for d in DOCUMENTS * 20), encoding="utf-8"
    )
    prefix = tmp_path / "data" / "corpus"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bridge.train.data.preprocess",
            "--input",
            str(corpus),
            "--output-prefix",
            str(prefix),
            "--json-key",
            "body",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "wrote 100 documents" in done.stdout

    cfg = ConfigContainer(
        train=tiny_train_config(train_iters=4, global_batch_size=4, micro_batch_size=2),
        model=tiny_gpt_provider(vocab_size=None),
        optimizer=tiny_optimizer_config(lr=3e-3),
        scheduler=tiny_scheduler_config(lr_warmup_iters=0),
        dataset=GPTDatasetConfig(
            random_seed=3,
            sequence_length=16,
            blend=([str(prefix)], None),
            split="9,1,0",
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            num_workers=0,
            create_attention_mask=False,
            path_to_cache=str(tmp_path / "cache"),
        ),
        tokenizer=TokenizerConfig(tokenizer_type="ByteLevelTokenizer"),
        logger=LoggerConfig(),
        checkpoint=CheckpointConfig(),
        dist=tiny_dist_config(),
    )
    config_path = tmp_path / "run.yaml"
    cfg.to_yaml(config_path)
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT, encoding="utf-8")

    run_torchrun(script, 2, [str(config_path), str(tmp_path / "dp2")], timeout=400)
    _run_bare(script, config_path, tmp_path / "bare")

    dp2 = [json.loads((tmp_path / f"dp2.{r}").read_text()) for r in range(2)]
    (single,) = [json.loads((tmp_path / "bare.0").read_text())]
    assert single["world"] == 1 and dp2[0]["world"] == 2
    for rank_result in dp2:
        assert rank_result["losses"] == pytest.approx(single["losses"], abs=1e-5)
        assert rank_result["consumed"] == 16
    assert single["losses"][-1] < single["losses"][0]
    # the first training sample decodes to the corpus: bytes between EODs are document parts
    first, eod = single["first"], single["eod"]
    pieces = bytes(t if t != eod else 0 for t in first).split(b"\0")
    encoded = [d.encode() for d in DOCUMENTS]
    assert all(any(piece in doc for doc in encoded) for piece in pieces)
