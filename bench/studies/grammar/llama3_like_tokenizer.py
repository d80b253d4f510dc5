"""Build a synthetic Llama-3-like tokenizer (128,256 tokens) without the hub: a byte-level BPE
trained here on local text, with Llama 3's pre-tokenizer split and its 256 special tokens.

    /tmp/gvenv/bin/python bench/studies/grammar/llama3_like_tokenizer.py \
        | tee bench/studies/grammar/llama3_like_tokenizer.txt

It writes `tokenizer.json` and `tokenizer_config.json` to /tmp/gtok/llama3-like (or `--out`),
which transformers loads as a fast tokenizer. The corpus is this machine's CPython standard
library sources plus /usr/share/doc text (about 48 MB), so the vocabulary is English- and
code-heavy: its size and byte-level shape match Llama 3's, not its exact token strings. The
grammar libraries' mask cost depends on both; treat the 128k figures as a shape check.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

NUM_MERGED = 128_000
"""Tokens from BPE training (the 256 byte tokens included); Llama 3 adds 256 specials."""

# Llama 3's pre-tokenizer pattern (a tiktoken-style split: contractions, letters, 1-3 digits,
# punctuation runs, newlines, spaces).
SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
] + [f"<|reserved_special_token_{i}|>" for i in range(3, 248)]


def corpus_files() -> list[Path]:
    stdlib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    docs = Path("/usr/share/doc")
    files += sorted(
        p
        for p in docs.rglob("*")
        if p.is_file() and (p.name == "copyright" or p.suffix in (".txt", ".md"))
    )
    return files


def lines(files: list[Path]) -> Iterator[str]:
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield from text.splitlines(keepends=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/gtok/llama3-like")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    files = corpus_files()
    size = sum(p.stat().st_size for p in files)
    print(f"corpus: {len(files)} files, {size / 1e6:.1f} MB")

    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=NUM_MERGED,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    start = time.perf_counter()
    tok.train_from_iterator(lines(files), trainer=trainer)
    trained = tok.get_vocab_size()
    print(f"trained {trained} tokens in {time.perf_counter() - start:.1f} s")
    tok.add_special_tokens(SPECIALS)
    total = tok.get_vocab_size()
    print(f"with {len(SPECIALS)} special tokens: {total} (Llama 3: 128256)")
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    sample = '{"order_id": "ORD-00012345", "items": [{"sku": "ABC-1234", "quantity": 3}]}'
    ids = tok.encode(sample).ids
    print(f"sample: {len(sample)} chars -> {len(ids)} tokens; decodes back: "
          f"{tok.decode(ids) == sample}")  # fmt: skip
    print(f"written to {out}")


if __name__ == "__main__":
    main()
