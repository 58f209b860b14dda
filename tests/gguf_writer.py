"""A Llama checkpoint written as a GGUF file the way llama.cpp's converter lays it out, so that the
tests can check that reading it back (minivllm/models/gguf.py) gives the original model.

Two things the converter does that a reader must undo: tensor names of its own (`blk.0.attn_q`), and
q/k rows permuted so that each head's two RoPE halves are interleaved (`_llama_cpp_permute`).
"""

from __future__ import annotations

from pathlib import Path

import torch


def _llama_cpp_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's row order for q/k: within each head, interleave the two RoPE halves."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_llama_gguf(hf_dir: str | Path, out_path: str | Path) -> Path:
    """Write a Llama safetensors checkpoint as an F32 GGUF file the way llama.cpp's converter lays it
    out (tensor names, metadata keys, permuted q/k rows, BPE tokenizer tables). For tests: reading it
    back must give the original model."""
    import json

    import gguf
    from safetensors.torch import load_file

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"], "only Llama checkpoints are written as GGUF here"
    state = load_file(str(hf_dir / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out_path), "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    tokens = [t for t, _ in vocab]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), cfg["vocab_size"])]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in added else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_eos_token_id(cfg["eos_token_id"])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                 "post_attention_layernorm": "ffn_norm"}
    for name, t in state.items():
        if name in names:
            out_name = names[name]
        else:
            _, _, layer, *rest = name.split(".")
            module = ".".join(rest[:-1])
            out_name = f"blk.{layer}.{per_layer[module]}.weight"
            if module == "self_attn.q_proj":
                t = _llama_cpp_permute(t, heads)
            elif module == "self_attn.k_proj":
                t = _llama_cpp_permute(t, kv_heads)
        w.add_tensor(out_name, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path
