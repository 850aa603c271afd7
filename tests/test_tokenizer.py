"""Tests for colo_rollout.text.tokenizer: loading, encode/decode, chat templates, eos ids, errors.

The reference for every rendering and id is transformers itself (skipped when it is absent),
run on a tiny tokenizer trained here in milliseconds (tests/tiny_tokenizer.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from colo_rollout.text.tokenizer import Tokenizer, TokenizerError
from tests.tiny_tokenizer import CHATML_TEMPLATE, EOS_TOKEN, save_tiny_tokenizer, train_tiny_tokenizer

TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "def main():\n    return 0\n",
    "<|im_start|>user\nhi<|im_end|>\n",  # special tokens inside text are matched as tokens
    "",
]
CONVERSATION = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "The answer is 4."},
]


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data), encoding="utf-8")


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    """A directory saved by transformers' own save_pretrained (chat template in chat_template.jinja)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=train_tiny_tokenizer(200),
        eos_token=EOS_TOKEN, pad_token="<|endoftext|>", unk_token="<unk>",
    )
    hf.chat_template = CHATML_TEMPLATE
    hf.save_pretrained(tmp_path)
    write_json(tmp_path / "generation_config.json", {"eos_token_id": [2, 0], "max_new_tokens": 8})
    return tmp_path


def test_tiny_tokenizer_fits_a_tiny_model(tmp_path: Path) -> None:
    assert save_tiny_tokenizer(tmp_path / "a", max_vocab=256) <= 256
    n = save_tiny_tokenizer(tmp_path / "b", max_vocab=150)
    assert n <= 150
    assert Tokenizer.from_dir(tmp_path / "b").vocab_size == n
    with pytest.raises(ValueError, match="max_vocab"):
        save_tiny_tokenizer(tmp_path / "c", max_vocab=50)


def test_matches_transformers(hf_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(hf_dir)
    tok = Tokenizer.from_dir(hf_dir)

    assert tok.vocab_size == len(ref)
    assert tok.eos_token_ids == (2, 0)
    assert tok.bos_token is None and tok.has_chat_template
    for text in TEXTS:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), text
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text  # exact round trip
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    for gen in (True, False):
        rendered = tok.apply_chat_template(CONVERSATION, add_generation_prompt=gen)
        assert rendered == ref.apply_chat_template(CONVERSATION, add_generation_prompt=gen, tokenize=False)
    assert tok.apply_chat_template(CONVERSATION).endswith("<|im_start|>assistant\n")

    prompt = "What is 2 + 2?"
    want = ref.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"]
    assert tok.encode_prompt(prompt) == list(want)
    assert tok.encode_prompt(prompt, chat=False) == ref.encode(prompt)


def test_config_template_matches_transformers(tmp_path: Path) -> None:
    """The helper's layout (template inside tokenizer_config.json), read by both sides."""
    transformers = pytest.importorskip("transformers")
    save_tiny_tokenizer(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == (tok.encode(EOS_TOKEN)[0],)  # no generation_config.json: from eos_token
    for gen in (True, False):
        assert tok.apply_chat_template(CONVERSATION, gen) == ref.apply_chat_template(
            CONVERSATION, add_generation_prompt=gen, tokenize=False)


def test_named_templates_special_tokens_and_tojson(tmp_path: Path) -> None:
    """A list of named templates picks 'default'; bos/eos strings and tojson (no ASCII escaping) reach it."""
    transformers = pytest.importorskip("transformers")
    save_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    default = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}={{ m | tojson }}{{ eos_token }}{% endfor %}"
               "{% if add_generation_prompt %}>{% endif %}")
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": default}]
    config["bos_token"] = {"__type": "AddedToken", "content": "<|endoftext|>", "special": True}
    config["eos_token"] = {"__type": "AddedToken", "content": EOS_TOKEN, "special": True}
    write_json(tmp_path / "tokenizer_config.json", config)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.bos_token == "<|endoftext|>"
    chat = [{"role": "user", "content": "caf\u00e9 <b>", "name": None}]  # None values are dropped, as in transformers
    rendered = tok.apply_chat_template(chat)
    assert rendered == ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert "caf\u00e9 <b>" in rendered and '"name"' not in rendered
    assert rendered.startswith("<|endoftext|>user=") and rendered.endswith(EOS_TOKEN + ">")

    # no 'default': the tokenizer loads and encodes (transformers too); rendering is refused
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}]
    write_json(tmp_path / "tokenizer_config.json", config)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.encode("hello") == ref.encode("hello")
    with pytest.raises(TokenizerError, match="no 'default'"):
        tok.apply_chat_template(chat)


def test_eos_ids(tmp_path: Path) -> None:
    save_tiny_tokenizer(tmp_path)
    eos = Tokenizer.from_dir(tmp_path).encode(EOS_TOKEN)[0]
    write_json(tmp_path / "generation_config.json", {"eos_token_id": 7})
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == (7,)
    write_json(tmp_path / "generation_config.json", {"eos_token_id": [7, 3, 7]})
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == (7, 3)  # deduplicated, order kept
    write_json(tmp_path / "generation_config.json", {"eos_token_id": "7"})
    with pytest.raises(TokenizerError, match="generation_config.json: eos_token_id"):
        Tokenizer.from_dir(tmp_path)
    write_json(tmp_path / "generation_config.json", {"temperature": 0.7})  # no eos there: the config's token
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == (eos,)

    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    write_json(tmp_path / "tokenizer_config.json", {**config, "eos_token": "<|nope|>"})
    # a named eos token tokenizer.json lacks is added as a special token, as transformers
    # adds it (the next free id)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == (tok.vocab_size - 1,) and tok.encode("<|nope|>") == [
        tok.vocab_size - 1]
    write_json(tmp_path / "tokenizer_config.json", {k: v for k, v in config.items() if k != "eos_token"})
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == ()


def test_eos_from_the_models_config_json(tmp_path: Path) -> None:
    """No generation_config.json: transformers' generate takes config.json's eos ids."""
    save_tiny_tokenizer(tmp_path)
    write_json(tmp_path / "config.json", {"eos_token_id": [5, 9]})
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == (5, 9)
    write_json(tmp_path / "generation_config.json", {"temperature": 0.7})  # it wins, eos-less
    assert Tokenizer.from_dir(tmp_path).eos_token_ids != (5, 9)


def test_a_checkpoint_without_eos_ids_stops_on_none(tmp_path: Path) -> None:
    """A checkpoint (config.json beside the tokenizer) whose generation_config.json has
    eos_token_id null or absent, or with no such file and none in config.json: transformers'
    generate stops on no id (runs to its length), so none here either -- not the tokenizer's
    eos_token (found by probing: completions were cut at <|im_end|> where transformers' went
    on). The tokenizer's stays the fallback of a directory without config.json."""
    transformers = pytest.importorskip("transformers")
    save_tiny_tokenizer(tmp_path)
    eos = Tokenizer.from_dir(tmp_path).encode(EOS_TOKEN)[0]
    write_json(tmp_path / "config.json", {"model_type": "qwen3_moe"})
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == ()  # no file: config.json's, none
    for gen in ({"eos_token_id": None}, {"temperature": 0.7}):
        write_json(tmp_path / "generation_config.json", gen)
        assert Tokenizer.from_dir(tmp_path).eos_token_ids == ()
        assert transformers.GenerationConfig.from_pretrained(tmp_path).eos_token_id is None
    (tmp_path / "config.json").unlink()  # a tokenizer directory: its eos_token
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == (eos,)


def test_templates_transformers_renders(tmp_path: Path) -> None:
    """tools / documents defined as None, the {% generation %} tag: rendered as transformers
    renders them; a template's raise_exception is one line naming the folder once."""
    transformers = pytest.importorskip("transformers")
    save_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    for template in ("{% if tools is not none %}T{% endif %}{% if documents is not none %}D"
                     "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}",
                     "{% for m in messages %}{% generation %}{{ m['content'] }}"
                     "{% endgeneration %}{% endfor %}"):
        write_json(tmp_path / "tokenizer_config.json", {**config, "chat_template": template})
        ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
        got = Tokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATION)
        assert got == ref.apply_chat_template(CONVERSATION, add_generation_prompt=True,
                                              tokenize=False), template
    write_json(tmp_path / "tokenizer_config.json",
               {**config, "chat_template": "{{ raise_exception('no\\nsystem') }}"})
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATION)
    assert str(e.value) == f"{tmp_path}: chat template refused the messages: no system"
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff{{ x }}")
    with pytest.raises(TokenizerError, match=r"chat_template\.jinja: unreadable "
                                             r"\(UnicodeDecodeError"):
        Tokenizer.from_dir(tmp_path)


def test_added_tokens_only_in_the_config_are_added(tmp_path: Path) -> None:
    """tokenizer_config.json's added_tokens_decoder entries missing from tokenizer.json are
    added, as transformers adds them (same ids for a prompt naming them); an entry whose id is
    not the next free one is refused, naming it."""
    transformers = pytest.importorskip("transformers")
    size = save_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    decoder = {str(size): {"content": "<think>", "special": False, "lstrip": False,
                           "rstrip": False, "normalized": False, "single_word": False},
               str(size + 1): {"content": "<tool>", "special": True}}
    write_json(tmp_path / "tokenizer_config.json", {**config, "added_tokens_decoder": decoder})
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    text = "the cat <think>dog<tool> end"
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False)
    assert size in tok.encode(text) and size + 1 in tok.encode(text)
    assert tok.vocab_size == size + 2 == len(ref)
    write_json(tmp_path / "tokenizer_config.json",
               {**config, "added_tokens_decoder": {str(size + 5): {"content": "<x>"}}})
    with pytest.raises(TokenizerError, match=rf"added_tokens_decoder: '<x>' \(id {size + 5}\) "
                                             rf"is not in tokenizer.json, whose next free id is "
                                             rf"{size}"):
        Tokenizer.from_dir(tmp_path)


def test_an_added_token_id_int_cannot_read_is_one_error(tmp_path: Path) -> None:
    """An added_tokens_decoder key of digits int() refuses ('²': isdigit() but not decimal)
    or cannot read (past Python's 4300-digit limit) is a TokenizerError naming the entry,
    shortened. Found by probing: both were ValueError tracebacks at the door."""
    save_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    path = tmp_path / "tokenizer_config.json"
    for key, shown in (("\u00b2", "'\u00b2'"), ("9" * 5000, "'" + "9" * 36 + "...")):
        write_json(path, {**config, "added_tokens_decoder": {key: {"content": "<x>"}}})
        with pytest.raises(TokenizerError) as e:
            Tokenizer.from_dir(tmp_path)
        assert str(e.value) == (f"{path}: added_tokens_decoder entry {shown} is not an id "
                                "with {content: ...}")


def test_a_template_nested_past_what_compiles_is_one_error(tmp_path: Path) -> None:
    """A template Jinja cannot compile for its depth -- its parser recursing past Python's
    limit, or Python's compiler refusing over 20 nested for loops -- is one TokenizerError,
    as transformers refuses it too. Found by probing: a RecursionError traceback at the door."""
    transformers = pytest.importorskip("transformers")
    save_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    chat = [{"role": "user", "content": "hi"}]
    for template, problem in (
            ("{% if true %}" * 3000 + "x" + "{% endif %}" * 3000, "nested too deeply"),
            ("{% for a in [1] %}" * 25 + "x" + "{% endfor %}" * 25,
             "SyntaxError: too many statically nested blocks")):
        write_json(tmp_path / "tokenizer_config.json", {**config, "chat_template": template})
        with pytest.raises(TokenizerError) as e:
            Tokenizer.from_dir(tmp_path).apply_chat_template(chat)
        assert str(e.value) == f"{tmp_path}: chat template does not compile ({problem})"
        with pytest.raises((RecursionError, SyntaxError)):
            transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
                chat, tokenize=False)


def test_a_template_that_renders_for_ever_is_cut_off(tmp_path: Path, monkeypatch) -> None:
    import colo_rollout.text.tokenizer as tk

    save_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    write_json(tmp_path / "tokenizer_config.json", {**config, "chat_template": loop})
    monkeypatch.setattr(tk, "RENDER_LIMIT_S", 0.5)
    with pytest.raises(TokenizerError, match="did not finish rendering within 0.5 s"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATION)


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    assert not Tokenizer.available(tmp_path)
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_dir(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'tokenizer.json'}: missing")

    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    assert Tokenizer.available(tmp_path)
    with pytest.raises(TokenizerError, match="tokenizer.json: unreadable"):
        Tokenizer.from_dir(tmp_path)

    save_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2", encoding="utf-8")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: unreadable JSON"):
        Tokenizer.from_dir(tmp_path)
    write_json(tmp_path / "tokenizer_config.json", [1, 2])
    with pytest.raises(TokenizerError, match="expected a JSON object"):
        Tokenizer.from_dir(tmp_path)
    # a folder or FIFO under a tokenizer file's name is named as such, never read as no file
    # (a FIFO would block a read) -- transformers fails on each
    save_tiny_tokenizer(tmp_path)
    for name in ("tokenizer_config.json", "chat_template.jinja", "tokenizer.json",
                 "generation_config.json"):
        target = tmp_path / name
        saved = target.read_bytes() if target.is_file() else None
        target.unlink(missing_ok=True)
        for make in (target.mkdir, lambda t=target: os.mkfifo(t)):
            make()
            with pytest.raises(TokenizerError) as e:
                Tokenizer.from_dir(tmp_path)
            assert str(e.value).startswith(f"{target}: not a regular file"), (name, str(e.value))
            target.rmdir() if target.is_dir() else target.unlink()
        if saved is not None:
            target.write_bytes(saved)


def test_without_chat_template(tmp_path: Path) -> None:
    save_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()  # tokenizer.json alone is a usable tokenizer
    tok = Tokenizer.from_dir(tmp_path)
    assert not tok.has_chat_template and tok.eos_token_ids == () and tok.bos_token is None
    assert tok.encode_prompt("hello world") == tok.encode("hello world")
    with pytest.raises(TokenizerError) as e:
        tok.apply_chat_template(CONVERSATION)
    assert str(e.value).startswith(f"{tmp_path}: no chat template")
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.encode_prompt("hello", chat=True)


def test_template_errors(tmp_path: Path) -> None:
    save_tiny_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerError) as e:
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    assert str(e.value).startswith(f"{tmp_path}: ") and "unknown role tool" in str(e.value)

    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    write_json(tmp_path / "tokenizer_config.json", {**config, "chat_template": "{% for m in messages %}"})
    tok = Tokenizer.from_dir(tmp_path)  # a broken template does not block plain encoding
    assert tok.encode("hello") and tok.has_chat_template
    with pytest.raises(TokenizerError, match="does not compile"):
        tok.apply_chat_template(CONVERSATION)

    # The sandbox holds: a template cannot reach Python internals.
    write_json(tmp_path / "tokenizer_config.json", {**config, "chat_template": "{{ messages.__class__.__mro__ }}"})
    with pytest.raises(TokenizerError, match="chat template failed"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATION)

    # an expression that fails as Python (not as Jinja) is the template's error too
    for template, what in (("{{ messages + 1 }}", "TypeError"),
                           ("{{ 1 // 0 }}", "ZeroDivisionError")):
        write_json(tmp_path / "tokenizer_config.json", {**config, "chat_template": template})
        with pytest.raises(TokenizerError, match=f"chat template failed \\({what}: "):
            Tokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATION)


def test_import_needs_neither_torch_nor_transformers() -> None:
    code = ("import sys, colo_rollout.text.tokenizer; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


# ---- tokenizer files as transformers 5 reads them (found by probing, session 31) ------------
_CORPUS = ["the quick brown fox jumps over the lazy dog",
           "hello world, Don't do it, isn't it ? yes !", "word word word"] * 5


def _byte_bpe():
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

    t = Backend(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(_CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return t


def _saved(directory: Path, backend, edit=None, **kw):
    """(directory, transformers' tokenizer of it): ``backend`` saved by transformers'
    PreTrainedTokenizerFast, then tokenizer_config.json edited by ``edit``."""
    transformers = pytest.importorskip("transformers")
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **kw).save_pretrained(directory)
    if edit is not None:
        path = directory / "tokenizer_config.json"
        config = json.loads(path.read_text())
        edit(config)
        write_json(path, config)
    return directory, transformers.AutoTokenizer.from_pretrained(directory)


def test_the_files_truncation_and_padding_do_not_cut_or_pad_prompts(tmp_path: Path) -> None:
    t = _byte_bpe()
    t.enable_truncation(max_length=8)
    d, ref = _saved(tmp_path / "trunc", t, eos_token="<|im_end|>")
    assert Tokenizer.from_dir(d).encode("word " * 20) == ref.encode("word " * 20)
    t = _byte_bpe()
    t.enable_padding(pad_id=0, pad_token="<|endoftext|>", length=12)
    d, ref = _saved(tmp_path / "pad", t, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    assert Tokenizer.from_dir(d).encode("hello") == ref.encode("hello")


def test_named_special_tokens_are_special_and_added(tmp_path: Path) -> None:
    from tokenizers import AddedToken

    text = "a <|pad|><|tool|> b<|eot|>"
    for key, value in (("pad_token", "<|pad|>"), ("additional_special_tokens", ["<|tool|>"]),
                       ("extra_special_tokens", ["<|tool|>"])):
        t = _byte_bpe()
        t.add_tokens([AddedToken("<|eot|>", special=False, normalized=False)])  # plain there
        d, ref = _saved(tmp_path / key, t, edit=lambda c: c.update({key: value,
                                                                     "eos_token": "<|eot|>"}))
        tok = Tokenizer.from_dir(d)
        assert tok.vocab_size == len(ref) and tok.encode(text) == ref.encode(text), key
        ids = ref.encode(text)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), key
        assert tok.eos_token_ids == (ref.eos_token_id,)


def test_config_flags_of_tokens_the_file_has_and_split_special_tokens(tmp_path: Path) -> None:
    from tokenizers import AddedToken

    t = _byte_bpe()
    t.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    flags = {"content": "<think>", "special": True, "lstrip": True, "rstrip": False,
             "normalized": False, "single_word": False}
    d, ref = _saved(tmp_path / "flags", t, eos_token="<|im_end|>", edit=lambda c: c.update(
        added_tokens_decoder={str(t.token_to_id("<think>")): flags}))
    tok, text = Tokenizer.from_dir(d), "x   <think>y"
    assert tok.encode(text) == ref.encode(text)
    assert tok.decode(ref.encode(text)) == ref.decode(ref.encode(text), skip_special_tokens=True)
    d, ref = _saved(tmp_path / "split", _byte_bpe(), eos_token="<|im_end|>",
                    edit=lambda c: c.update(split_special_tokens=True))
    assert Tokenizer.from_dir(d).encode("<|im_end|>") == ref.encode("<|im_end|>")


def test_spaces_are_cleaned_up_where_transformers_cleans_them(tmp_path: Path) -> None:
    """clean_up_tokenization_spaces: transformers 5 applies it except to BPE models."""
    from tokenizers import Tokenizer as Backend, decoders, models, normalizers, pre_tokenizers
    from tokenizers import trainers

    t = Backend(models.WordPiece(unk_token="[UNK]"))
    t.normalizer = normalizers.BertNormalizer(lowercase=True)
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    t.decoder = decoders.WordPiece()
    t.train_from_iterator(_CORPUS, trainers.WordPieceTrainer(vocab_size=200,
                                                             special_tokens=["[UNK]"],
                                                             show_progress=False))
    for clean in (True, False):
        d, ref = _saved(tmp_path / f"wp{clean}", t, unk_token="[UNK]",
                        edit=lambda c: c.update(clean_up_tokenization_spaces=clean))
        ids = ref.encode("Don't do it, isn't it ? yes !")
        assert Tokenizer.from_dir(d).decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_wrong_arguments_are_named_not_passed_to_the_backend(hf_dir: Path) -> None:
    """Found by probing: the Rust backend's errors for these named neither the argument nor
    the problem (OverflowError for -1, "TextInputSequence must be str" for a lone surrogate,
    a dict-constructor ValueError for a str conversation), and 1.7 decoded as id 1."""
    import numpy as np
    import torch

    tok = Tokenizer.from_dir(hf_dir)
    ids = tok.encode("hello world")
    assert tok.decode(np.array(ids)) == tok.decode(ids) == tok.decode(torch.tensor(ids))
    for bad, err, want in (([-1], ValueError, "id 0 \\(-1\\) is not a token id"),
                           ([1, 2 ** 40], ValueError, "id 1 .* is not a token id"),
                           ([1.7], TypeError, "id 0 is not an integer: float"),
                           ([True], TypeError, "id 0 is not an integer: bool"),
                           ("abc", TypeError, "ids must be a sequence of token ids, got str")):
        with pytest.raises(err, match=want):
            tok.decode(bad)
    for bad, err, want in ((None, TypeError, "text must be a str, got NoneType"),
                           (5, TypeError, "text must be a str, got int"),
                           ("a\ud800", ValueError, "not valid Unicode")):
        with pytest.raises(err, match=want):
            tok.encode(bad)
    for bad, want in (("hi", "messages must be a list of dicts .* got str"),
                      ([None], "message 0 must be a dict .* got NoneType"),
                      (None, "messages must be a list of dicts .* got NoneType")):
        with pytest.raises(TypeError, match=want):
            tok.apply_chat_template(bad)
    with pytest.raises(TypeError, match="prompt must be a str, got NoneType"):
        tok.encode_prompt(None)
