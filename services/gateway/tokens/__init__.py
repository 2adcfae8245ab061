"""The model's tokens and text: the tokenizer with its chat template, and the incremental detokenizer."""
