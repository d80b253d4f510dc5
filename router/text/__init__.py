"""Text: the tokenizer and chat template (prompts in), incremental detokenization (text out)."""
