"""bridge-generate on megatron-core's inference machinery, against ``transformers`` (CPU, fp32).

A tiny random Llama (GQA, llama3 RoPE scaling) is imported with ``bridge-convert``'s API and
generated from: greedy completions of four prompts of different lengths (one batch) equal
``transformers``' ``generate`` token for token; the logits each token was chosen from (KV
cache) equal a full forward's; seeded sampling repeats; a stop string ends a completion at
the token that completes it; streamed text adds up to the completion; TP=2 generates the
tokens one process does. The command refuses bad input with one line and exit code 2.

One 1-rank and one 2-rank process group are forked for everything.

A tiny random Mixtral (4 experts, top-2 routing) is the mixture-of-experts case: its greedy
completions equal ``transformers``' too, and its KV-cached logits a full forward's.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from bridge.train.testing import write_word_level_tokenizer  # noqa: E402
from core_utils.testing import run_distributed  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

VOCAB = 300
SEQ = 64
NEW = 32
PROMPTS = [
    [5, 17, 250],
    [3, 9, 44, 120, 7, 81, 200],
    [60] * 2 + list(range(30, 40)),
    [2, 4, 8, 16, 32],
]


def _sharpened(model: Any, noise_norms: bool = True) -> Any:
    """Larger weights (sharper, more varied next-token choices) and, unless the norms are
    already random, random norm weights."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                if noise_norms:
                    param.add_(torch.randn_like(param) * 0.1)
            elif not name.endswith("bias"):
                param.mul_(4.0)
    return model


def _hf_llama(directory: Path) -> Any:
    torch.manual_seed(4321)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    model = _sharpened(transformers.LlamaForCausalLM(config).float().eval())
    model.save_pretrained(directory)
    write_word_level_tokenizer(directory, VOCAB)
    return model


def _hf_mixtral(directory: Path) -> Any:
    """A tiny random Mixtral (4 experts, top-2 routing, GQA): the MoE family's case."""
    torch.manual_seed(8765)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    model = _sharpened(transformers.MixtralForCausalLM(config).float().eval())
    model.save_pretrained(directory)
    write_word_level_tokenizer(directory, VOCAB)
    return model


def _hf_greedy(model: Any) -> list[list[int]]:
    """transformers' greedy ``generate``, one prompt at a time, past the end-of-sequence id."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            result = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False
            )
        out.append(result[0, len(prompt) :].tolist())
    return out


def _cli(argv: list[str]) -> tuple[int, str, str]:
    from bridge.train.generate import cli

    out, err = io.StringIO(), io.StringIO()
    code: Any = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main(argv)
        except SystemExit as exc:
            code = exc.code
    return int(code or 0), out.getvalue(), err.getvalue()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _interactive_session(argv: list[str], typed: str) -> tuple[int, str, str]:
    """The command at a terminal: ``typed`` is what the user enters (then Ctrl-D)."""
    import sys

    from bridge.train.generate import cli

    out, err = io.StringIO(), io.StringIO()
    terminal = _Terminal(typed)
    saved = sys.stdin
    sys.stdin = terminal
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.run(argv, stdin=terminal)
    finally:
        sys.stdin = saved
    return code, out.getvalue(), err.getvalue()


def _full_forward_logits(model: Any, ids: list[int]) -> torch.Tensor:
    chunk = model[0]
    tokens = torch.tensor([ids])
    with torch.no_grad():
        logits = chunk(tokens, torch.arange(len(ids))[None], None)
    return logits[0, :, :VOCAB].float()


def _one_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    from bridge.train.convert import import_hf_checkpoint
    from bridge.train.generate import SamplingOptions, load_generation_model

    base = Path(root)
    ckpt = base / "ckpt"
    import_hf_checkpoint(base / "hf", ckpt, seq_length=SEQ)
    out: dict[str, Any] = {}
    import_hf_checkpoint(base / "hf_moe", base / "ckpt_moe", seq_length=SEQ)
    loaded = load_generation_model(base / "ckpt_moe")
    try:
        greedy_moe = loaded.generator().generate(
            PROMPTS, SamplingOptions(NEW, stop_at_eod=False), return_logits=True
        )
        out["moe_greedy"] = [c.token_ids for c in greedy_moe]
        out["moe_logit_error"] = max(
            float(
                (_full_forward_logits(loaded.model, p + c.token_ids[:-1])[len(p) - 1 :] - c.logits)
                .abs()
                .max()
            )
            for p, c in zip(PROMPTS, greedy_moe, strict=True)
        )
    finally:
        loaded.close()
    loaded = load_generation_model(ckpt)
    try:
        generator = loaded.generator(max_batch_size=8)
        greedy = SamplingOptions(NEW, stop_at_eod=False)
        completions = generator.generate(PROMPTS, greedy, return_logits=True)
        out["greedy"] = [c.token_ids for c in completions]
        out["reasons"] = [c.finish_reason for c in completions]
        out["logit_error"] = max(
            float(
                (_full_forward_logits(loaded.model, p + c.token_ids[:-1])[len(p) - 1 :] - c.logits)
                .abs()
                .max()
            )
            for p, c in zip(PROMPTS, completions, strict=True)
        )
        # Keys rotated before caching: the same logits, bit for bit, as megatron's own
        # static path (which rotates every cached key again at every step).
        from bridge.train.generate import generator as generator_module
        from bridge.train.generate.rotary_cache import rotate_keys_before_caching

        # (Without left padding, which megatron's path does not have.)
        with rotate_keys_before_caching(loaded.model[0]) as switched:
            out["rotary_layers_switched"] = switched
        generator.pads_prompts = False
        try:
            rotated = generator.generate(PROMPTS, greedy, return_logits=True)
            with mock.patch.object(
                generator_module,
                "rotate_keys_before_caching",
                lambda _: contextlib.nullcontext(0),
            ):
                plain = generator.generate(PROMPTS, greedy, return_logits=True)
        finally:
            generator.pads_prompts = True
        out["plain_greedy"] = [c.token_ids for c in plain]
        out["plain_logits_equal"] = all(
            torch.equal(a.logits, b.logits) for a, b in zip(plain, rotated, strict=True)
        )
        out["instance_attributes_left"] = [
            name
            for name, module in loaded.model[0].named_modules()
            if "_adjust_key_value_for_inference" in vars(module)
        ]
        alone = [generator.generate([p], greedy, return_logits=True)[0] for p in PROMPTS]
        out["one_by_one"] = [c.token_ids for c in alone]
        out["batched_vs_alone_logit_error"] = max(
            float((a.logits - b.logits).abs().max())
            for a, b in zip(alone, completions, strict=True)
        )
        # Prompts of 3 to 12 tokens in one batch: one prefill, then one step per new token
        # (megatron's static path alone takes 12 - 3 steps more, feeding the longer prompts).
        forwards: list[int] = []
        hook = loaded.model[0].register_forward_hook(lambda *_: forwards.append(1))
        try:
            generator.generate(PROMPTS, greedy)
        finally:
            hook.remove()
        out["batched_forward_steps"] = len(forwards)
        sample = SamplingOptions.sampling(NEW, temperature=0.9, top_k=20, seed=7, stop_at_eod=False)
        out["sampled"] = [
            [c.token_ids for c in generator.generate(PROMPTS, sample)] for _ in range(2)
        ]
        other = SamplingOptions.sampling(NEW, temperature=0.9, top_k=20, seed=8, stop_at_eod=False)
        out["sampled_other_seed"] = [c.token_ids for c in generator.generate(PROMPTS, other)]
        nucleus = SamplingOptions.sampling(NEW, top_p=0.8, seed=3, stop_at_eod=False)
        out["nucleus"] = [
            [c.token_ids for c in generator.generate(PROMPTS[:2], nucleus)] for _ in range(2)
        ]
        # A stop string: the first generated word that does not occur in the text before it.
        ids = out["greedy"][1]
        tokenizer = loaded.tokenizer
        cut = next(
            j
            for j in range(3, NEW)
            if tokenizer.detokenize(ids[j : j + 1]) not in tokenizer.detokenize(ids[:j])
        )
        stop = tokenizer.detokenize(ids[cut : cut + 1])
        # In a batch: the row is left-padded, the stop string is found after its padding.
        stopped = generator.generate(
            PROMPTS, SamplingOptions(NEW, stop=(stop,), stop_at_eod=False)
        )[1]
        out["stop"] = {
            "cut": cut,
            "word": stop,
            "token_ids": stopped.token_ids,
            "text": stopped.text,
            "reason": stopped.finish_reason,
            "before": tokenizer.detokenize(ids[:cut]),
        }
        pieces: list[tuple[int, str, bool]] = []
        streamed = generator.generate(
            PROMPTS,
            SamplingOptions(NEW, stop_at_eod=False),
            on_text=lambda i, text, done: pieces.append((i, text, done)) if i == 0 else None,
        )[0]
        out["stream"] = {"pieces": pieces, "text": streamed.text}
        # Megatron's InferenceMode flag: off after a generation started with it off, still on
        # after one started inside the caller's own inference block.
        from megatron.core.inference.utils import InferenceMode

        short = SamplingOptions(2, stop_at_eod=False)
        generator.generate(PROMPTS[:1], short)
        out["inference_mode_after"] = {"off": InferenceMode.is_active()}
        InferenceMode.set_active()
        try:
            generator.generate(PROMPTS[:1], short)
            out["inference_mode_after"]["on"] = InferenceMode.is_active()
        finally:
            InferenceMode.unset_active()
        # The forward steps run without the CUDA emulation's device rewriting (the loop
        # around them keeps it); a CUDA device named inside a forward fails loudly.
        modes: list[list[str]] = []

        def _modes(*_: Any) -> None:
            stack = torch.overrides._get_current_function_mode_stack()
            modes.append([type(mode).__name__ for mode in stack])

        hook = loaded.model[0].register_forward_pre_hook(_modes)
        try:
            generator.generate(PROMPTS[:1], short)
        finally:
            hook.remove()
        _modes()
        out["modes"] = {"forward": modes[:-1], "outside": modes[-1]}
        hook = loaded.model[0].register_forward_pre_hook(lambda *_: torch.zeros(1, device="cuda"))
        try:
            generator.generate(PROMPTS[:1], short)
        except Exception as exc:  # asserted by the test
            out["cuda_in_forward"] = f"{type(exc).__name__}: {exc}"
        finally:
            hook.remove()
        out["after_cuda_in_forward"] = [c.token_ids for c in generator.generate(PROMPTS, greedy)]
    finally:
        loaded.close()

    # The command: --json, then bad input (each one line, exit 2).
    prompt_text = " ".join(f"w{i}" for i in PROMPTS[3])
    out["cli_json"] = _cli(
        [str(ckpt), "--prompt", prompt_text, "--max-new-tokens", str(NEW), "--json", "--ignore-eod"]
    )
    from bridge.train.generate import cli

    piped = io.StringIO()
    with contextlib.redirect_stdout(piped), contextlib.redirect_stderr(io.StringIO()):
        cli.run(
            [str(ckpt), "--max-new-tokens", "5", "--json", "--ignore-eod"],
            stdin=io.StringIO(prompt_text + "\n\nw9 w10\n"),
        )
    out["cli_piped"] = piped.getvalue()
    out["cli_interactive"] = _interactive_session(
        [str(ckpt), "--max-new-tokens", "3", "--ignore-eod"],
        f"{prompt_text}\n\n{' '.join(['w7'] * SEQ)}\nw9 w10\n",
    )
    damaged = base / "damaged"
    shutil.copytree(ckpt, damaged)
    shard = sorted((damaged / "iter_0000000").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    lora = base / "lora_without_base"
    shutil.copytree(ckpt, lora)
    run_config = lora / "iter_0000000" / "run_config.yaml"
    config = yaml.safe_load(run_config.read_text())
    config["peft"] = {"_target_": "bridge.train.peft.LoRA", "dim": 4, "alpha": 8}
    config["checkpoint"]["pretrained_checkpoint"] = str(base / "gone")
    run_config.write_text(yaml.safe_dump(config))
    no_run_config = base / "no_run_config"
    shutil.copytree(ckpt, no_run_config)
    (no_run_config / "iter_0000000" / "run_config.yaml").unlink()
    unreadable = base / "unreadable_run_config"
    shutil.copytree(ckpt, unreadable)
    (unreadable / "iter_0000000" / "run_config.yaml").write_text("model: [unclosed\n")
    write_word_level_tokenizer(base / "bigger_tokenizer", VOCAB + 40)
    long_prompt = " ".join(["w7"] * SEQ)
    cases = {
        "missing": [str(base / "nowhere")],
        "damaged": [str(damaged)],
        "long_prompt": [str(ckpt), "--prompt", long_prompt],
        "too_many_new_tokens": [str(ckpt), "--prompt", "w5 w6", "--max-new-tokens", str(SEQ)],
        "tokenizer_mismatch": [str(ckpt), "--tokenizer", str(base / "bigger_tokenizer")],
        "lora_without_base": [str(lora)],
        "no_run_config": [str(no_run_config)],
        "unreadable_run_config": [str(unreadable)],
        "top_k_and_top_p": [str(ckpt), "--top-k", "5", "--top-p", "0.5"],
        "pipeline_on_cpu": [str(ckpt), "--pp", "2"],
    }
    out["refusals"] = {}
    for name, argv in cases.items():
        if "--max-new-tokens" not in argv:
            argv = [*argv, "--max-new-tokens", "4"]
        if "--prompt" not in argv:
            argv = [*argv, "--prompt", "w5"]
        out["refusals"][name] = _cli(argv)
    return out


def _two_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    from bridge.train.generate import SamplingOptions, load_generation_model

    loaded = load_generation_model(Path(root) / "ckpt")
    try:
        assert loaded.provider.tensor_model_parallel_size == 2
        generator = loaded.generator()
        greedy = generator.generate(PROMPTS, SamplingOptions(NEW, stop_at_eod=False))
        sample = SamplingOptions.sampling(NEW, temperature=0.9, top_k=20, seed=7, stop_at_eod=False)
        sampled = generator.generate(PROMPTS, sample)
        return {
            "greedy": [c.token_ids for c in greedy],
            "sampled": [c.token_ids for c in sampled],
        }
    finally:
        loaded.close()


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("generate")
    model = _hf_llama(root / "hf")
    reference = _hf_greedy(model)
    moe_reference = _hf_greedy(_hf_mixtral(root / "hf_moe"))
    (single,) = run_distributed(_one_rank, 1, str(root), timeout=600)
    double = run_distributed(_two_ranks, 2, str(root), timeout=400)
    return {"reference": reference, "moe_reference": moe_reference, "one": single, "two": double}


def test_greedy_equals_transformers_generate(generated: dict[str, Any]) -> None:
    """4 prompts of different lengths in one batch, 32 new tokens, token for token."""
    assert generated["one"]["greedy"] == generated["reference"]
    assert generated["one"]["one_by_one"] == generated["reference"]
    assert generated["one"]["reasons"] == ["length"] * len(PROMPTS)


def test_kv_cached_logits_equal_full_forward(generated: dict[str, Any]) -> None:
    assert generated["one"]["logit_error"] < 1e-5


def test_prompts_of_different_lengths_share_one_prefill(generated: dict[str, Any]) -> None:
    """Left-padded and masked: one forward for all four prompts, then one per new token;
    each row's logits are the ones it gets alone (row 0, the shortest, is padded most)."""
    one = generated["one"]
    assert one["batched_forward_steps"] == NEW
    assert one["batched_vs_alone_logit_error"] < 1e-5
    assert one["greedy"] == one["one_by_one"]


def test_rotating_keys_before_caching_changes_no_logit(generated: dict[str, Any]) -> None:
    """Keys cached after RoPE (rotary_cache) against megatron's static path, which caches
    them before RoPE and rotates the whole cache at every step: the same tokens and the
    same logits bit for bit, on every attention layer, and nothing left on the modules."""
    one = generated["one"]
    assert one["rotary_layers_switched"] == 2
    assert one["plain_greedy"] == one["greedy"]
    assert one["plain_logits_equal"]
    assert one["instance_attributes_left"] == []


def test_forward_steps_run_without_the_device_rewriting(generated: dict[str, Any]) -> None:
    """On CPU the CUDA emulation's TorchFunctionMode is suspended for megatron's forward steps
    (core_utils.without_device_rewriting) and active around them; a CUDA device named in a
    forward fails loudly, and the generator works as before afterwards."""
    one = generated["one"]
    assert one["modes"]["outside"] == ["_CudaToCpuMode"]
    assert len(one["modes"]["forward"]) == 2  # the prefill and one decoding step
    assert all(stack == [] for stack in one["modes"]["forward"])
    assert one["cuda_in_forward"].startswith("CudaEmulationError: a CUDA tensor created at")
    assert "without_device_rewriting()" in one["cuda_in_forward"]
    assert one["after_cuda_in_forward"] == one["greedy"]


def test_moe_greedy_equals_transformers_generate(generated: dict[str, Any]) -> None:
    """An imported Mixtral (4 experts, top-2): the same 4 prompts, 32 tokens each."""
    assert generated["one"]["moe_greedy"] == generated["moe_reference"]
    assert generated["one"]["moe_logit_error"] < 1e-5


def test_tensor_parallel_generates_what_one_process_does(generated: dict[str, Any]) -> None:
    one = generated["one"]
    for rank_result in generated["two"]:
        assert rank_result["greedy"] == one["greedy"]
    assert generated["two"][0]["sampled"] == generated["two"][1]["sampled"]


def test_seeded_sampling_is_reproducible(generated: dict[str, Any]) -> None:
    one = generated["one"]
    first, second = one["sampled"]
    assert first == second
    assert first != one["sampled_other_seed"]
    assert first != one["greedy"]
    assert one["nucleus"][0] == one["nucleus"][1]


def test_stop_string_ends_generation_where_it_should(generated: dict[str, Any]) -> None:
    stop = generated["one"]["stop"]
    greedy = generated["one"]["greedy"][1]
    assert stop["reason"] == "stop"
    assert stop["token_ids"] == greedy[: stop["cut"] + 1]  # up to the completing token
    assert stop["word"] not in stop["text"]
    assert stop["text"] == " " + stop["before"] + " "  # the text before the stop string


def test_streamed_text_adds_up_to_the_completion(generated: dict[str, Any]) -> None:
    stream = generated["one"]["stream"]
    pieces = stream["pieces"]
    assert len(pieces) > 1 and all(index == 0 for index, _, _ in pieces)
    assert "".join(text for _, text, _ in pieces) == stream["text"]
    assert [done for _, _, done in pieces] == [False] * (len(pieces) - 1) + [True]


def test_generation_leaves_the_callers_inference_mode_as_it_was(
    generated: dict[str, Any],
) -> None:
    assert generated["one"]["inference_mode_after"] == {"off": False, "on": True}


def test_inference_mode_active_restores_the_previous_state() -> None:
    from megatron.core.inference.utils import InferenceMode

    from bridge.train.generate.generator import inference_mode_active

    assert not InferenceMode.is_active()
    with inference_mode_active():
        assert InferenceMode.is_active()
    assert not InferenceMode.is_active()
    InferenceMode.set_active()
    try:
        with pytest.raises(RuntimeError), inference_mode_active():
            raise RuntimeError("the block fails")
        assert InferenceMode.is_active()
    finally:
        InferenceMode.unset_active()


def test_command_json_output(generated: dict[str, Any]) -> None:
    code, out, err = generated["one"]["cli_json"]
    assert code == 0, err
    (line,) = out.splitlines()
    record = json.loads(line)
    assert record["token_ids"] == generated["reference"][3]
    # What the new tokens add to the prompt's text: the word-level tokenizer joins words
    # with spaces, so the completion starts with the one after the prompt.
    assert record["completion"] == " " + " ".join(f"w{i}" for i in record["token_ids"])
    assert record["prompt"] == " ".join(f"w{i}" for i in PROMPTS[3])
    assert record["finish_reason"] == "length"


def test_command_reads_piped_prompts(generated: dict[str, Any]) -> None:
    records = [json.loads(line) for line in generated["one"]["cli_piped"].splitlines()]
    assert [r["prompt"] for r in records] == [" ".join(f"w{i}" for i in PROMPTS[3]), "w9 w10"]
    assert records[0]["token_ids"] == generated["reference"][3][:5]
    assert all(len(r["token_ids"]) == 5 for r in records)


def test_interactive_session_completes_each_line(generated: dict[str, Any]) -> None:
    """At a terminal: one streamed completion per line entered; an empty line is skipped, a
    prompt that does not fit is refused with one line and the session goes on to the next."""
    code, out, err = generated["one"]["cli_interactive"]
    assert code == 0, err
    first = " ".join(f"w{i}" for i in PROMPTS[3] + generated["reference"][3][:3])
    lines = out.replace("> ", "").splitlines()
    assert len(lines) == 2 and lines[0] == first
    assert lines[1].startswith("w9 w10 w") and len(lines[1].split()) == 5
    assert err.count("bridge-generate: error:") == 1 and "longer than the model's context" in err


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("missing", "does not exist"),
        ("damaged", "damaged"),
        ("long_prompt", "longer than the model's context"),
        ("too_many_new_tokens", "exceeds the model's context"),
        ("tokenizer_mismatch", "tokenizer mismatch"),
        ("lora_without_base", "LoRA adapters only"),
        ("no_run_config", "has no run_config.yaml; the model and tokenizer"),
        ("unreadable_run_config", "run_config.yaml cannot be read: "),
        ("top_k_and_top_p", "--top-k and --top-p"),
        ("pipeline_on_cpu", "--pp 2"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    generated: dict[str, Any], case: str, needle: str
) -> None:
    code, out, err = generated["one"]["refusals"][case]
    assert code == 2, (out, err)
    lines = [line for line in err.splitlines() if line.startswith("bridge-generate: error:")]
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


# ---- every family bridge-convert imports (extended tier: ~3 min) ---------------------------


def _hf_families(randomized: Any) -> dict[str, Any]:
    """Tiny random models of the other imported families: sliding windows shorter than the
    generated sequences (Mistral; Gemma 3's interleaved local/global layers with their own RoPE
    bases), tied embeddings (Qwen2, GPT-2), learned positions (GPT-2), QK norms (Qwen3),
    experts with a dense layer among them (Qwen3-MoE)."""
    common: dict[str, Any] = {"vocab_size": VOCAB, "max_position_embeddings": SEQ}
    attention: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    three = {**attention, "num_hidden_layers": 3}
    configs = {
        "qwen2": transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**attention, tie_word_embeddings=True, **common)
        ),
        "mistral": transformers.MistralForCausalLM(
            transformers.MistralConfig(
                **attention, sliding_window=5, tie_word_embeddings=False, **common
            )
        ),
        "gpt2": transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                n_embd=64, n_layer=2, n_head=4, n_positions=SEQ, vocab_size=VOCAB
            )
        ),
        "qwen3": transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(**attention, head_dim=24, tie_word_embeddings=False, **common)
        ),
        "qwen3_moe": transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(
                **three,
                moe_intermediate_size=32,
                head_dim=16,
                num_experts=4,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                mlp_only_layers=[1],
                tie_word_embeddings=False,
                **common,
            )
        ),
        "gemma3": transformers.Gemma3ForCausalLM(
            transformers.Gemma3TextConfig(
                **three,
                head_dim=16,
                sliding_window=4,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                query_pre_attn_scalar=24,
                rope_parameters={
                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                },
                **common,
            )
        ),
    }
    return {
        name: _sharpened(randomized(model), noise_norms=False) for name, model in configs.items()
    }


def _family_rank(rank: int, world: int, root: str, names: list[str]) -> dict[str, Any]:
    from bridge.train.convert import import_hf_checkpoint
    from bridge.train.generate import SamplingOptions, load_generation_model

    out: dict[str, Any] = {}
    for name in names:
        ckpt = Path(root) / f"ckpt_{name}"
        import_hf_checkpoint(Path(root) / name, ckpt, seq_length=SEQ)
        loaded = load_generation_model(ckpt)
        try:
            completions = loaded.generator().generate(
                PROMPTS, SamplingOptions(NEW, stop_at_eod=False), return_logits=True
            )
            out[name] = {
                "greedy": [c.token_ids for c in completions],
                "logit_error": max(
                    float(
                        (
                            _full_forward_logits(loaded.model, p + c.token_ids[:-1])[len(p) - 1 :]
                            - c.logits
                        )
                        .abs()
                        .max()
                    )
                    for p, c in zip(PROMPTS, completions, strict=True)
                ),
            }
        finally:
            loaded.close()
    return out


@pytest.mark.extended
def test_every_imported_family_generates_what_transformers_does(
    tmp_path: Path, randomized: Any
) -> None:
    """Qwen2, Mistral, GPT-2, Qwen3, Qwen3-MoE and Gemma 3 (Llama and Mixtral are above):
    greedy, 4 prompts of different lengths in one batch, 32 new tokens each, token for token
    with ``transformers``' ``generate``; KV-cached logits equal a full forward's within 1e-5."""
    torch.manual_seed(0)
    reference = {}
    for name, model in _hf_families(randomized).items():
        model.save_pretrained(tmp_path / name)
        write_word_level_tokenizer(tmp_path / name, VOCAB)
        reference[name] = _hf_greedy(model)
    (got,) = run_distributed(_family_rank, 1, str(tmp_path), list(reference), timeout=900)
    assert {name: got[name]["greedy"] == reference[name] for name in reference} == dict.fromkeys(
        reference, True
    )
    errors = {name: got[name]["logit_error"] for name in reference}
    assert all(error < 1e-5 for error in errors.values()), errors
