"""A model directory with random weights and a synthetic word-level tokenizer, for the sweep.

`write_model_dir(path, shape)` writes what a worker (`KVRAIL_MODEL=<path>`) and the router load
from any safetensors directory: `config.json`, random weights in safetensors shards, and a
`tokenizers` tokenizer with a chat template. Nothing is downloaded.

Why a synthetic tokenizer and not a real one. The shape is Llama-3-8B's, vocabulary included
(128,256 rows in the embedding and the LM head). The Llama-3 tokenizer is not on these machines,
and a real byte-level BPE tokenizer on a random-weight model breaks the measurement:
- the detokenizer holds back a token that ends in a partial UTF-8 character, so that token's
  chunk carries no text and the client sees one gap of two tokens (an ITL twice the real one);
- an end-of-sequence token can come up and end a request early (the router has no ignore_eos).
Here every id is a whole word (`[UNK]`, the three role markers, the load generator's `WORDS`,
then `t<id>`), every generated token decodes to a non-empty " word", and there is no
end-of-sequence token: every request runs to its max_tokens and every token is one text chunk.
A one-message prompt of N load-generator words is exactly N + 2 tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
UNK = "[UNK]"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""`<|user|> hello world <|assistant|>`: each message is its role marker and its words, then
one `<|assistant|>`."""

SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.1-8B: the context is limited by KVRAIL_MAX_MODEL_LEN, not by the config.
    "llama3-8b": {
        "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "max_position_embeddings": 131072,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192},
    },
    # A few layers of small width: the serving bench's CPU runs, where the model's own time
    # must stay small beside the stack's.
    "tiny": {
        "vocab_size": 8192, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "max_position_embeddings": 8192,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    # SmolLM2-135M, for the CPU smoke run.
    "smollm2-135m": {
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "max_position_embeddings": 8192,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    },
}  # fmt: skip


def vocabulary(vocab_size: int, words: Iterable[str]) -> dict[str, int]:
    """Token -> id: `[UNK]`, the role markers, `words` (deduplicated, in order), then `t<id>`
    up to `vocab_size`. Raises ValueError when the named tokens do not fit."""
    named = list(dict.fromkeys([UNK, *ROLE_TOKENS, *words]))
    if len(named) > vocab_size:
        raise ValueError(f"{len(named)} named tokens do not fit a vocabulary of {vocab_size}")
    vocab = {token: i for i, token in enumerate(named)}
    for i in range(len(named), vocab_size):
        vocab[f"t{i}"] = i
    return vocab


def write_tokenizer(path: Path, vocab_size: int, words: Sequence[str]) -> None:
    """tokenizer.json (word level, split on whitespace) and tokenizer_config.json with the chat
    template and no end-of-sequence token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocabulary(vocab_size, words), unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": UNK,
              "chat_template": CHAT_TEMPLATE, "model_max_length": 1 << 20}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


def weight_shapes(shape: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Every transformers-named weight of a Llama decoder of `shape`, in layer order."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    out: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (shape["vocab_size"], h))
    ]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not shape["tie_word_embeddings"]:
        out.append(("lm_head.weight", (shape["vocab_size"], h)))
    return out


def write_model_dir(
    path: Path, shape_name: str, words: Sequence[str], *, device: str = "cpu", seed: int = 0,
    shard_bytes: int = 2 << 30,
) -> dict[str, Any]:  # fmt: skip
    """Write config.json, random bf16 weights (normal(0, 0.02), norms 1, as the engine's
    `init_random`) in shards of about `shard_bytes`, and the tokenizer. Drawn on `device` (the
    GPU draws 16 GB in a moment); idempotent: a directory with `kvrail-random.json` is kept.
    Returns what it wrote (shape, seed, number of parameters)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    marker = path / "kvrail-random.json"
    if marker.is_file():
        return dict(json.loads(marker.read_text()))
    shape = SHAPES[shape_name]
    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config.architectures = ["LlamaForCausalLM"]  # what vLLM (the sweep's `vllm` setup) loads by
    config.dtype = "bfloat16"  # the weights' dtype; kvrail's workers read neither
    config.save_pretrained(path)
    write_tokenizer(path, shape["vocab_size"], words)
    generator = torch.Generator(device=device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    num_params = num_shards = 0

    def flush() -> None:
        nonlocal num_shards
        if shard:
            save_file(shard, str(path / f"model-{num_shards:05d}.safetensors"), {"format": "pt"})
            num_shards += 1
            shard.clear()

    for name, dims in weight_shapes(shape):
        if name.endswith("norm.weight"):
            tensor = torch.ones(dims, dtype=torch.bfloat16)
        else:
            values = torch.randn(dims, generator=generator, device=device, dtype=torch.float32)
            tensor = (values * 0.02).to(torch.bfloat16).cpu()
        shard[name] = tensor
        num_params += tensor.numel()
        if sum(t.numel() * 2 for t in shard.values()) >= shard_bytes:
            flush()
    flush()
    info = {"shape": shape_name, "seed": seed, "num_params": num_params,
            "num_shards": num_shards, "dtype": "bfloat16",
            "tokenizer": "synthetic word level (bench/sweep/model.py)"}  # fmt: skip
    marker.write_text(json.dumps(info) + "\n")
    return info
