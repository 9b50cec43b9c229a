"""Tiny GGUF files written the way llama.cpp's converter writes them, for the conversion tests.

:func:`write_tiny_gguf` takes a randomised transformers model (Llama or Qwen3 at the tests' SMALL
size), permutes a Llama model's q/k rows as llama.cpp does (rotary pairs interleaved), quantizes
the projections (Q8_0 / Q4_1) and writes the file with a byte-level BPE tokenizer of 256 byte
tokens, two merges and three ChatML specials (vocabulary 261) and a ChatML template.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MERGES = ("Ġ t", "h e")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
FIRST_SPECIAL = 256 + len(MERGES)  # byte tokens, then the merged ones, then the specials
VOCAB = FIRST_SPECIAL + len(SPECIALS)


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-in for each byte (the byte-level BPE alphabet)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation (its converter's ``permute``): halves -> interleaved pairs."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_tiny_gguf(path: Path, torch_model, *, arch: str = "llama", quantize: bool = True) -> Path:
    import gguf
    from gguf.quants import quantize as quantize_array

    cfg = torch_model.config
    assert cfg.vocab_size == VOCAB, f"the tiny tokenizer has {VOCAB} tokens"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(512)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    merged = [m.replace(" ", "") for m in MERGES]
    w.add_token_list([*_byte_tokens(), *merged, *SPECIALS])
    w.add_token_types([1] * FIRST_SPECIAL + [3] * len(SPECIALS))
    w.add_token_merges(list(MERGES))
    w.add_bos_token_id(FIRST_SPECIAL + 1)
    w.add_eos_token_id(FIRST_SPECIAL + 2)
    w.add_pad_token_id(FIRST_SPECIAL + 2)
    w.add_chat_template(CHATML)
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, p in torch_model.state_dict().items():
        x = p.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            out = "output.weight"
        else:
            layer, rest = name[len("model.layers.") :].split(".", 1)
            body, kind = rest.rsplit(".", 1)
            out = f"blk.{layer}.{names[body]}.{kind}"
            if arch == "llama" and body == "self_attn.q_proj":
                x = llama_cpp_permute(x, cfg.num_attention_heads)
            elif arch == "llama" and body == "self_attn.k_proj":
                x = llama_cpp_permute(x, cfg.num_key_value_heads)
        if quantize and x.ndim == 2 and x.shape[1] % 32 == 0:
            qtype = (
                gguf.GGMLQuantizationType.Q4_1 if "ffn" in out else gguf.GGMLQuantizationType.Q8_0
            )
            w.add_tensor(out, quantize_array(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(out, np.ascontiguousarray(x, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
