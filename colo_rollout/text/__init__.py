"""Text in, text out: the tokenizer of a checkpoint, for callers of rollout() and the generate command."""
