"""Shared fixtures of bridge-train's tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

# Documents of the small corpus several data tests tokenize.
CORPUS_DOCUMENTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Megatron trains transformers; bridge makes it portable.",
    "Pack my box with five dozen liquor jugs!",
    "Sphinx of black quartz, judge my vow.",
    "How vexingly quick daft zebras jump.",
    "Unicode works too: naïve café, 数据, ✓.",
]


@pytest.fixture(scope="session")
def corpus_documents() -> list[str]:
    """The documents of the test corpus."""
    return list(CORPUS_DOCUMENTS)


@pytest.fixture
def corpus_jsonl(tmp_path: Path) -> Path:
    """The corpus as JSONL (one document per line under "text"), repeated for volume."""
    path = tmp_path / "corpus.jsonl"
    with path.open("w", encoding="utf-8") as handle:
        for _ in range(8):
            for doc in CORPUS_DOCUMENTS:
                handle.write(json.dumps({"text": doc, "id": len(doc)}) + "\n")
    return path


# ---- Hugging Face family parity (used by the test_hf_family_*.py files) --------------------

HF_VOCAB = 300  # megatron pads it to 384 at TP=1, 512 at TP=2
HF_SEQ = 12


def _padded_batch() -> tuple[Any, Any, Any]:
    """Two rows of ``HF_SEQ`` tokens; the second left-padded by 4 (positions restart at the
    first real token, as transformers' generation computes them)."""
    import torch

    tokens = torch.randint(2, HF_VOCAB, (2, HF_SEQ), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(2, HF_SEQ, dtype=torch.long)
    mask[1, :4] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return tokens, mask, positions


def _hf_logits(model: Any) -> Any:
    import torch

    tokens, mask, positions = _padded_batch()
    with torch.no_grad():
        return model(tokens, attention_mask=mask, position_ids=positions).logits


def _megatron_logits(model: Any, tp_group: Any) -> Any:
    """Logits of the padded batch through a megatron GPTModel (gathered over TP)."""
    import torch
    import torch.distributed as dist

    tokens, mask, positions = _padded_batch()
    causal = torch.ones(HF_SEQ, HF_SEQ, dtype=torch.bool).triu(1)
    attention_mask = causal[None, None] | (mask == 0)[:, None, None, :]
    with torch.no_grad():
        logits = model(tokens, positions, attention_mask)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, logits.contiguous(), group=tp_group)
        logits = torch.cat(parts, dim=-1)
    return logits[..., :HF_VOCAB].clone()


def _pipeline_logits(chunks: list[Any]) -> Any:
    """Logits of the padded batch through megatron-core's forward-only pipeline schedule
    (one micro-batch per row); the last stage returns them, the others ``None``."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens, mask, positions = _padded_batch()
    causal = torch.ones(HF_SEQ, HF_SEQ, dtype=torch.bool).triu(1)
    rows = iter(range(tokens.shape[0]))

    def step(data_iterator: Any, model: Any) -> Any:
        i = next(data_iterator)
        attention_mask = causal[None, None] | (mask[i : i + 1] == 0)[:, None, None, :]
        output = model(tokens[i : i + 1], positions[i : i + 1], attention_mask)

        def collect(output_tensor: Any, non_loss_data: bool = False) -> Any:
            return output_tensor.detach().clone()

        return output, collect

    with torch.no_grad():
        collected = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=rows,
            model=chunks,
            num_microbatches=tokens.shape[0],
            seq_length=HF_SEQ,
            micro_batch_size=1,
            decoder_seq_length=HF_SEQ,
            forward_only=True,
            collect_non_loss_data=True,
        )
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return torch.cat(list(collected))[..., :HF_VOCAB]


def _family_worker(
    rank: int, world: int, hf_dir: str, layouts: list[dict[str, int]], export: str | None
) -> dict[str, Any]:
    """On every rank: per layout, build the model through AutoBridge, load the Hugging Face
    weights, compute the logits; save the first layout's model with save_hf_pretrained and
    export_hf_weights."""
    from megatron.core import parallel_state

    from bridge.config import DistributedInitConfig
    from bridge.train.convert import AutoBridge
    from bridge.train.engine import build_engine
    from bridge.train.engine.initialize import destroy_distributed

    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    out: dict[str, Any] = {}
    for index, layout in enumerate(layouts):
        name = ",".join(f"{k}{v}" for k, v in layout.items())
        provider = bridge.to_megatron_provider(
            tensor_model_parallel_size=layout.get("tp", 1),
            pipeline_model_parallel_size=layout.get("pp", 1),
            expert_model_parallel_size=layout.get("ep", 1),
        )
        # The engine's setup: on CPU megatron's MoE layers run under its CUDA emulation.
        build_engine().initialize_distributed(
            provider, DistributedInitConfig(distributed_backend="gloo")
        )
        try:
            model = provider.provide()
            model.eval()
            bridge.load_hf_weights(model)
            if provider.pipeline_model_parallel_size > 1:
                out[name] = _pipeline_logits([model])
            else:
                out[name] = _megatron_logits(
                    model, parallel_state.get_tensor_model_parallel_group()
                )
            if index == 0 and export is not None:
                bridge.save_hf_pretrained(model, export)
                # The iterator every rank walks; rank 0 gets the tensors.
                exported = dict(bridge.export_hf_weights(model))
                out["exported"] = exported if rank == 0 else None
        finally:
            destroy_distributed()
    return out


def _convert_worker(
    rank: int, world: int, hf: str, root: str, import_args: list[str]
) -> dict[str, Any]:
    import contextlib
    import io

    from bridge.train.convert import cli

    out: dict[str, Any] = {}
    for direction, argv in (
        ("import", ["import", hf, f"{root}/ckpt", *import_args]),
        ("export", ["export", f"{root}/ckpt", f"{root}/converted"]),
    ):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            out[direction] = (cli.main(argv), err.getvalue())
    return out


def _relative_error(got: Any, want: Any) -> float:
    """max |got - want| / max |want| over the real (not padded) positions."""
    _, mask, _ = _padded_batch()
    keep = mask.bool()
    return float((got - want)[keep].abs().max() / want[keep].abs().max())


class FamilyParity:
    """The checks every Hugging Face family's test file runs (see docs/models.md).

    ``run(model, layouts, world)`` saves the tiny ``transformers`` model (with a word-level
    tokenizer) under ``tmp``, computes its logits on a left-padded batch, then in one forked
    ``world``-rank gloo group builds the model at each layout through ``AutoBridge``
    (megatron engine machinery, CUDA emulation on CPU), loads the weights, computes the
    logits, and saves the first layout's model back with ``save_hf_pretrained``.
    """

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp

    def save(self, model: Any, name: str = "hf") -> Path:
        """Save ``model`` and a tokenizer; returns the directory."""
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel
        from tokenizers.pre_tokenizers import Whitespace

        directory = self.tmp / name
        model.save_pretrained(directory)
        vocab = {"</s>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, HF_VOCAB - 20)}}
        tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
        tokenizer.pre_tokenizer = Whitespace()
        tokenizer.save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(
            json.dumps({"eos_token": "</s>", "chat_template": "{{ messages }}"})
        )
        return directory

    def run(
        self, model: Any, layouts: list[dict[str, int]], world: int = 2, timeout: float = 600
    ) -> dict[str, Any]:
        """Returns ``{"reference", "layouts": {name: logits}, "hf", "export", "exported"}``
        (``exported``: the first layout's ``export_hf_weights`` tensors)."""
        from core_utils.testing import run_distributed

        hf = self.save(model.float().eval())
        export = self.tmp / "export"
        ranks = run_distributed(
            _family_worker, world, str(hf), layouts, str(export), timeout=timeout
        )
        found: dict[str, Any] = {}
        for result in ranks:
            for name, logits in result.items():
                if logits is not None:
                    found.setdefault(name, logits)
        exported = found.pop("exported")
        return {
            "reference": _hf_logits(model),
            "layouts": found,
            "hf": hf,
            "export": export,
            "exported": exported,
        }

    def convert_round_trip(self, hf: Path, *import_args: str) -> dict[str, Any]:
        """``bridge-convert import`` (with ``import_args``) then ``export`` of ``hf`` in a
        forked one-rank process; returns the exit codes and messages and the export's
        directory."""
        from core_utils.testing import run_distributed

        (codes,) = run_distributed(
            _convert_worker, 1, str(hf), str(self.tmp), list(import_args), timeout=600
        )
        return {**codes, "converted": self.tmp / "converted"}

    def assert_convert_round_trip_is_source(self, result: dict[str, Any]) -> None:
        """``bridge-convert`` import and export (``result["convert"]``, from
        :meth:`convert_round_trip`) both exited 0 and the export is the source bit for bit
        (:meth:`assert_saved_is_source`)."""
        convert = result["convert"]
        for direction in ("import", "export"):
            code, err = convert[direction]
            assert code == 0, (direction, err)
        self.assert_saved_is_source(result, convert["converted"])

    def assert_logits_match(self, result: dict[str, Any], layout: str) -> None:
        """The layout's logits equal transformers' within 1e-5 relative."""
        error = _relative_error(result["layouts"][layout], result["reference"])
        assert error <= 1e-5, (layout, error)

    def assert_saved_is_source(self, result: dict[str, Any], saved: Path | None = None) -> None:
        """A save (default: ``save_hf_pretrained``'s, and ``export_hf_weights``' tensors)
        holds the source's tensors bit for bit and loads in transformers with the source's
        logits and tokenizer."""
        import torch
        import transformers

        out = result["export"] if saved is None else saved
        source, written = self.tensors(result["hf"]), self.tensors(out)
        assert sorted(source) == sorted(written)
        if saved is None:
            exported = result["exported"]
            assert sorted(exported) == sorted(source)
            for name, tensor in source.items():
                assert torch.equal(exported[name].to(tensor.dtype), tensor), name
        for name, tensor in source.items():
            assert written[name].dtype == tensor.dtype, name
            assert torch.equal(written[name], tensor), name
        model = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
        assert torch.equal(_hf_logits(model), result["reference"])
        assert (out / "tokenizer.json").is_file()
        assert (out / "generation_config.json").is_file()
        tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
        assert tokenizer_config["chat_template"] == "{{ messages }}"

    @staticmethod
    def refusal(config: dict[str, Any]) -> str:
        """The one-line message ``provider_from_hf_config`` refuses ``config`` with."""
        from bridge.train.convert import ConversionError, provider_from_hf_config

        try:
            provider_from_hf_config(config)
        except ConversionError as exc:
            message = str(exc)
            assert "\n" not in message, message
            return message
        raise AssertionError(f"not refused: {config}")

    @staticmethod
    def relative_error(got: Any, want: Any) -> float:
        """max |got - want| / max |want| over the batch's real positions."""
        return _relative_error(got, want)

    @staticmethod
    def tensors(directory: Path) -> dict[str, Any]:
        """Every tensor of a directory's safetensors files."""
        from safetensors.torch import load_file

        result: dict[str, Any] = {}
        for file in sorted(directory.glob("*.safetensors")):
            result.update(load_file(str(file)))
        return result

    @staticmethod
    def megatron_logits(model: Any, tp_group: Any) -> Any:
        """A megatron GPTModel's logits on the padded batch (gathered over ``tp_group``)."""
        return _megatron_logits(model, tp_group)

    @staticmethod
    def hf_logits(model: Any) -> Any:
        """A transformers model's logits on the padded batch."""
        return _hf_logits(model)


@pytest.fixture(scope="session")
def family_parity() -> type[FamilyParity]:
    """The shared Hugging Face family checks (:class:`FamilyParity`; construct it with a
    directory, e.g. in a module-scoped fixture)."""
    return FamilyParity


def randomize_hf(model: Any, seed: int = 1234) -> Any:
    """Give a fresh transformers model's zero/one-initialised tensors (norms, biases,
    routers) random values, so every mapping is exercised."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "ln_" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
            elif name.endswith("gate.weight") and param.dim() == 2 and param.shape[0] < 64:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return model.float().eval()


@pytest.fixture(scope="session")
def randomized() -> Any:
    """:func:`randomize_hf`."""
    return randomize_hf


# ---- the parity tests every family file shares ------------------------------------------
#
# A test_hf_family_*.py file declares ``PARITY = {"model": build, "layouts": [...]}`` (and
# optionally ``"convert": [import args]`` for a bridge-convert round trip, ``"four_ranks":
# [layouts]`` for the extended tier); ``build(randomized)`` returns the tiny transformers
# model. The hook below then collects :class:`ParityTests` (with :class:`ConvertRoundTrip`
# and :class:`FourRanks` when asked) in that file, run against one module-scoped 2-rank
# group (the ``parity`` fixture).


def _layout_name(layout: dict[str, int]) -> str:
    return ",".join(f"{k}{v}" for k, v in layout.items())


@pytest.fixture(scope="module")
def parity(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The module's ``PARITY`` run once: :meth:`FamilyParity.run` (and
    :meth:`FamilyParity.convert_round_trip` when it names ``convert``)."""
    spec = request.module.PARITY
    checks = FamilyParity(tmp_path_factory.mktemp("parity"))
    result = checks.run(spec["model"](randomize_hf), spec["layouts"])
    if "convert" in spec:
        result["convert"] = checks.convert_round_trip(result["hf"], *spec["convert"])
    return {"checks": checks, **result}


class ParityTests:
    """Logits at every layout equal transformers'; ``save_hf_pretrained`` of the first
    layout's model is the source bit for bit and loads in transformers."""

    @pytest.mark.multiprocess
    @pytest.mark.timeout(900)
    def test_logits_match_transformers(self, parity: dict[str, Any], layout: str) -> None:
        parity["checks"].assert_logits_match(parity, layout)

    @pytest.mark.multiprocess
    @pytest.mark.timeout(900)
    def test_save_of_a_load_is_bit_identical_and_loads(self, parity: dict[str, Any]) -> None:
        parity["checks"].assert_saved_is_source(parity)


class ConvertRoundTrip:
    """``bridge-convert`` import then export is the source bit for bit."""

    @pytest.mark.multiprocess
    @pytest.mark.timeout(900)
    def test_bridge_convert_round_trip_is_bit_identical(self, parity: dict[str, Any]) -> None:
        parity["checks"].assert_convert_round_trip_is_source(parity)


class FourRanks:
    """The ``four_ranks`` layouts (expert x tensor parallel) on four ranks, and their save."""

    @pytest.mark.extended
    @pytest.mark.multiprocess
    @pytest.mark.timeout(1200)
    def test_four_ranks(self, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        spec = request.module.PARITY
        checks = FamilyParity(tmp_path)
        result = checks.run(spec["model"](randomize_hf), spec["four_ranks"], world=4)
        for layout in spec["four_ranks"]:
            checks.assert_logits_match(result, _layout_name(layout))
        checks.assert_saved_is_source(result)


def pytest_pycollect_makeitem(collector: Any, name: str, obj: object) -> Any:
    """Collect the shared parity tests where a family file declares ``PARITY``."""
    if name != "PARITY" or not isinstance(obj, dict):
        return None
    bases: list[type] = [ParityTests]
    bases += [ConvertRoundTrip] if "convert" in obj else []
    bases += [FourRanks] if "four_ranks" in obj else []
    tests = type("TestFamilyParity", tuple(bases), {"__doc__": ParityTests.__doc__})
    setattr(collector.obj, tests.__name__, tests)  # where pytest looks the class up
    return pytest.Class.from_parent(collector, name=tests.__name__)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``layout``: each of the module's ``PARITY`` layouts."""
    spec = getattr(metafunc.module, "PARITY", None)
    if spec is not None and "layout" in metafunc.fixturenames:
        metafunc.parametrize("layout", [_layout_name(layout) for layout in spec["layouts"]])
