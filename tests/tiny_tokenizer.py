"""A tiny ChatML tokenizer for tests: trained in milliseconds with the `tokenizers` package alone.

Its vocabulary fits a tiny test model (<= max_vocab ids, added tokens included), it round-trips
any text made of printable ASCII and newlines, and it is saved the way a Qwen checkpoint saves
its tokenizer (tokenizer.json + tokenizer_config.json with a ChatML chat_template).
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
EOS_TOKEN = "<|im_end|>"

# Qwen2-style ChatML; the whitespace-control markers exercise trim_blocks/lstrip_blocks, and
# raise_exception is how real templates reject a conversation.
CHATML_TEMPLATE = """{%- for message in messages %}
    {%- if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Every character the tokenizer knows; spaces travel as the metaspace mark.
_ALPHABET = [c for c in string.printable if c not in " \t\r\x0b\x0c"] + ["\u2581"]

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny tokenizer for tests",
    "You are a helpful assistant.",
    "system user assistant",
    "What is 2 + 2? The answer is 4.",
    "Rollout engines generate tokens for reinforcement learning.",
    "Mixture of experts models route each token to a few experts.",
    "def main():\n    return 0\n",
    "the cat sat on the mat and the dog sat on the log",
    "prefill and decode share the same GPUs in a colocated engine",
] * 3


def train_tiny_tokenizer(max_vocab: int = 200) -> Tokenizer:
    """A BPE tokenizer of at most `max_vocab` ids: the ASCII alphabet, the special tokens, then merges."""
    floor = len(_ALPHABET) + len(SPECIAL_TOKENS)
    if max_vocab < floor:
        raise ValueError(f"max_vocab={max_vocab} is below the alphabet plus special tokens ({floor})")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # prepend_scheme 'never': no invented leading space, so decode(encode(text)) == text exactly.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tok.decoder = decoders.Metaspace(prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=max_vocab, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=_ALPHABET, limit_alphabet=len(_ALPHABET), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    assert tok.get_vocab_size(with_added_tokens=True) <= max_vocab
    return tok


def save_tiny_tokenizer(directory: str | Path, max_vocab: int = 200) -> int:
    """Write tokenizer.json and tokenizer_config.json into `directory`; returns the vocab size (<= max_vocab)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = train_tiny_tokenizer(max_vocab)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return tok.get_vocab_size(with_added_tokens=True)
