"""The tokenizer of a Hugging Face checkpoint directory: text <-> token ids, and chat-template rendering.

This module owns turning prompts into token ids and generated ids back into text. The engine and
rollout() stay token-in/token-out; this is a helper around them for callers that hold text (the
generate command, examples, RL reward code). It reads only the files that `save_pretrained` writes
next to the weights and needs the `tokenizers` and `jinja2` packages, never transformers or torch,
so importing it costs nothing on a rank that only moves tokens.
"""

from __future__ import annotations

import contextlib
import json
import operator
import signal
import threading
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

# The longest a chat template may render (real ones take milliseconds; a template is untrusted code
# from the Hub, and one looping for hours would hang the door silently)
RENDER_LIMIT_S = 10.0

# Special-token names a chat template may read, as transformers passes them (its special_tokens_map).
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_ids(ids: Iterable[int]) -> list[int]:
    """``ids`` as the backend's list of ints: each an integer (numpy's, a 0-d integer
    tensor's), never a bool, a float truncated or text read as digits, in the backend's
    32-bit range (found by probing: the backend's own errors were OverflowError /
    ValueError naming no id, and 1.7 decoded as id 1)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise TypeError(f"decode: ids must be a sequence of token ids, got {type(ids).__name__}")
    out = []
    for n, i in enumerate(ids):
        try:
            if isinstance(i, bool):
                raise TypeError
            v = operator.index(i)
        except TypeError:
            raise TypeError(f"decode: id {n} is not an integer: {type(i).__name__} "
                            f"{i!r:.40}") from None
        if not 0 <= v < 2 ** 32:
            raise ValueError(f"decode: id {n} ({v}) is not a token id")
        out.append(v)
    return out


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be used; the message reads 'PATH: problem'."""

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)


_NOT_REGULAR = "not a regular file (a directory, FIFO or device)"


def _short(value: Any) -> str:
    """``value`` for a message, at most ~40 characters (an int of 400 digits, say)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, or None when the file does not exist (a folder, FIFO or
    device under its name is an error: transformers fails on it too -- found by probing, it
    was read as no file)."""
    if not path.is_file():
        if path.exists():
            raise TokenizerError(path, _NOT_REGULAR)
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: JSON, UTF-8, big ints
        problem = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise TokenizerError(path, f"unreadable JSON ({problem})") from None
    if not isinstance(data, dict):
        raise TokenizerError(path, f"expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes a special token either as its string or as an AddedToken dict.
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


class _NoDefault(str):
    """A chat_template list without a 'default' entry: the problem, raised at rendering."""


def _pick_template(path: Path, value: Any) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {"name", "template"} (use "default")."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
        # refused when a template is rendered, not at load: encode and decode still work, as in
        # transformers (found by probing: the whole tokenizer was refused)
        return _NoDefault(f"{path}: chat_template lists {sorted(map(str, named))} but no "
                          "'default'")
    raise TokenizerError(path, f"chat_template must be a string or a list, got {type(value).__name__}")


def _add_config_tokens(backend: Any, path: Path, decoder: Any) -> None:
    """tokenizer_config.json's ``added_tokens_decoder`` ({id: {content, special, lstrip,
    rstrip, normalized, single_word}}): the tokens tokenizer.json lacks are added, as
    transformers adds them. Each must take the id it names -- the next free one, in id order
    (the ``tokenizers`` backend appends); any other id is refused, naming it."""
    from tokenizers import AddedToken

    if decoder is None:
        return
    if not isinstance(decoder, dict):
        raise TokenizerError(path, f"added_tokens_decoder must be an object, got "
                             f"{type(decoder).__name__}")
    entries = []
    for key, tok in decoder.items():
        # an id int() reads (isdigit() also holds for '²', which int() refuses) and short
        # enough to read at all: no vocabulary has 10^18 ids (found by probing: a key of 5000
        # digits or '²' was a ValueError traceback)
        if not (isinstance(key, str) and key.isdecimal() and len(key) <= 18
                and isinstance(tok, dict) and isinstance(tok.get("content"), str)
                and tok["content"]):
            raise TokenizerError(path, f"added_tokens_decoder entry {_short(key)} is not an id "
                                 "with {content: ...}")
        entries.append((int(key), tok))
    for tid, tok in sorted(entries, key=lambda e: e[0]):
        content = tok["content"]
        have = backend.token_to_id(content)
        if have is not None and have != tid:
            raise TokenizerError(path, f"added_tokens_decoder: {content!r} is id {tid} "
                                 f"there and {have} in tokenizer.json")
        size = backend.get_vocab_size(with_added_tokens=True)
        if have is None and tid != size:
            raise TokenizerError(path, f"added_tokens_decoder: {content!r} (id {tid}) is not in "
                                 f"tokenizer.json, whose next free id is {size}")
        # a token tokenizer.json has takes the config's flags too (found by probing: a
        # config marking <think> special and lstrip was read without them)
        flags = {k: bool(tok[k]) for k in ("single_word", "lstrip", "rstrip", "normalized")
                 if k in tok}
        special = bool(tok.get("special", False))
        token = AddedToken(content, special=special, **flags)
        (backend.add_special_tokens if special else backend.add_tokens)([token])


def _add_named_specials(backend: Any, config: Mapping[str, Any]) -> None:
    """The special tokens tokenizer_config.json names -- bos/eos/unk/sep/pad/cls/mask,
    ``additional_special_tokens``, ``extra_special_tokens`` -- are special, as transformers
    makes them: added (the next free id) where tokenizer.json lacks them, else marked special
    (split out before the model's pre-tokenizer, dropped by a skipping decode). Found by
    probing: a named eos token tokenizer.json held as plain text decoded as text; a pad
    token it lacked was split into bytes."""
    from tokenizers import AddedToken

    names = [_token_content(config.get(n)) for n in _SPECIAL_TOKEN_NAMES]
    for key in ("additional_special_tokens", "extra_special_tokens"):
        more = config.get(key)
        if isinstance(more, Mapping):
            more = list(more.values())
        if isinstance(more, list):
            names += [_token_content(t) for t in more]
    for name in dict.fromkeys(n for n in names if n):
        backend.add_special_tokens([AddedToken(name, special=True, normalized=False)])


def _clean_up_spaces(text: str) -> str:
    """transformers' ``clean_up_tokenization``: the spaces a word-level decoder leaves before
    punctuation and English contractions."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                 (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                 (" 're", "'re")):
        text = text.replace(a, b)
    return text


@contextlib.contextmanager
def _time_limit(directory: Path, seconds: float):
    """A TokenizerError if the body runs past ``seconds`` (SIGALRM: the main thread only, where
    the door renders; elsewhere unbounded). The previous handler and timer are put back."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expired(signum, frame):
        raise TokenizerError(directory, f"chat template did not finish rendering within "
                             f"{seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    left, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if left:  # someone else's timer was running: give it back what it had left
            signal.setitimer(signal.ITIMER_REAL, left)


class Tokenizer:
    """The tokenizer saved next to a Hugging Face checkpoint: tokenizer.json (fast tokenizer,
    loaded with the `tokenizers` package) plus tokenizer_config.json (special tokens, chat_template)
    and generation_config.json (eos ids) when present. No transformers dependency."""

    def __init__(self, directory: Path, backend: Any, config: dict[str, Any],
                 chat_template: str | None, eos_token_ids: tuple[int, ...]) -> None:
        # Use from_dir(); this constructor trusts that its arguments were read from `directory`.
        self.directory = directory
        self._backend = backend
        self._chat_template = chat_template
        # (the model's class names its type: no serialisation of a 150k-entry vocabulary)
        self._clean_up = (config.get("clean_up_tokenization_spaces") is True
                          and type(backend.model).__name__ != "BPE")
        self._compiled: Any = None  # the jinja Template, compiled on first use (a bad one must not block encode)
        # Only the special tokens the config names reach the template, as in transformers: an absent one
        # is undefined there (renders as ''), never the string 'None'.
        self._special = {n: s for n in _SPECIAL_TOKEN_NAMES if (s := _token_content(config.get(n))) is not None}
        self.bos_token: str | None = self._special.get("bos_token")
        self.eos_token_ids = eos_token_ids
        # Ids the tokenizer can emit, added tokens included (transformers' len(tokenizer)): a model's
        # embedding must have at least this many rows.
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    @staticmethod
    def available(directory: str | Path) -> bool:
        """Whether `directory` holds a tokenizer.json (a checkpoint may ship weights only)."""
        return (Path(directory) / "tokenizer.json").is_file()

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer:
        from tokenizers import Tokenizer as Backend  # imported here: a token-only caller never needs it

        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(path, _NOT_REGULAR if path.exists()
                                 else "missing (no tokenizer saved with this checkpoint)")
        try:
            backend = Backend.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for bad JSON or an unknown model
            raise TokenizerError(path, f"unreadable ({e})") from e
        # encode() is one whole sequence, as transformers' encode (it switches the file's
        # truncation and padding off; found by probing: prompts were cut or padded)
        backend.no_truncation()
        backend.no_padding()
        config_path = directory / "tokenizer_config.json"
        config = _read_json(config_path) or {}
        _add_config_tokens(backend, config_path, config.get("added_tokens_decoder"))
        _add_named_specials(backend, config)
        if config.get("split_special_tokens") is True:  # special tokens' text as plain text
            backend.encode_special_tokens = True
        # transformers >= 4.43 saves the template as chat_template.jinja, which wins over the config entry.
        jinja_path = directory / "chat_template.jinja"
        if jinja_path.exists() and not jinja_path.is_file():
            raise TokenizerError(jinja_path, _NOT_REGULAR)
        if jinja_path.is_file():
            try:
                template: str | None = jinja_path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(jinja_path, f"unreadable ({type(e).__name__}: "
                                     f"{' '.join(str(e).split())[:200]})") from None
        else:
            template = _pick_template(config_path, config.get("chat_template"))

        # eos ids as transformers' generate takes them: generation_config.json's, else the
        # model's config.json's (GenerationConfig.from_model_config) -- null or absent there:
        # none, generate runs to its length (found by probing: the tokenizer's eos_token was
        # taken, the completion cut where transformers' goes on, and the engine's own
        # checkpoint_eos_ids said none). Only a directory without config.json (a tokenizer,
        # no model for generate to read) falls back to the tokenizer's eos_token.
        gen_path = directory / "generation_config.json"
        eos: Any = (_read_json(gen_path) or {}).get("eos_token_id")
        model = (directory / "config.json").is_file()
        if eos is None and not gen_path.is_file():
            gen_path = directory / "config.json"
            eos = (_read_json(gen_path) or {}).get("eos_token_id")
        if eos is None and model:
            ids = []
        elif eos is not None:
            ids = [eos] if isinstance(eos, int) else eos
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise TokenizerError(gen_path, f"eos_token_id must be an int or a list of ints, got {eos!r}")
        elif (name := _token_content(config.get("eos_token"))) is not None:
            # A named eos token the vocabulary lacks would make generation run to max_tokens silently.
            if (tid := backend.token_to_id(name)) is None:
                raise TokenizerError(config_path, f"eos_token {name!r} is not in the vocabulary")
            ids = [tid]
        else:
            ids = []
        return cls(directory, backend, config, template, tuple(dict.fromkeys(ids)))

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # checked here: the Rust backend's own errors for these name neither the argument nor
        # the problem ("TextInputSequence must be str" for a lone surrogate too)
        if not isinstance(text, str):
            raise TypeError(f"encode: text must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("encode: the text is not valid Unicode (a lone surrogate)") from None
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        text = self._backend.decode(_token_ids(ids), skip_special_tokens=skip_special_tokens)
        # transformers 5 cleans up spaces where the config asks, except for BPE models
        return _clean_up_spaces(text) if self._clean_up else text

    def _template(self) -> Any:
        if self._compiled is not None:
            return self._compiled
        if self._chat_template is None:
            raise TokenizerError(self.directory, "no chat template (neither chat_template.jinja nor "
                                 "tokenizer_config.json's chat_template)")
        if isinstance(self._chat_template, _NoDefault):
            path, problem = str(self._chat_template).split(": ", 1)
            raise TokenizerError(path, problem)
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        directory = self.directory

        def raise_exception(message: str) -> None:
            text = " ".join(str(message).split())  # one line, whatever the template wrote
            raise TokenizerError(directory, f"chat template refused the messages: {text}")

        class GenerationTag(jinja2.ext.Extension):
            """``{% generation %}...{% endgeneration %}`` (transformers' AssistantTracker: it
            marks the assistant's tokens for training masks): the body rendered as it is."""

            tags = {"generation"}

            def parse(self, parser):
                next(parser.stream)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
            # Jinja's own tojson HTML-escapes; templates expect plain json.dumps, as transformers gives them.
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        # The same environment transformers builds: templates come from the Hub and are untrusted code.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols, GenerationTag])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._compiled = env.from_string(self._chat_template)
        except jinja2.TemplateError as e:
            raise TokenizerError(directory, f"chat template does not compile ({e})") from e
        except (SyntaxError, RecursionError) as e:  # Jinja's parser recursing, or Python's
            # compiler refusing its code (over 20 nested for loops): found by probing, a
            # traceback at the door; transformers refuses such a template alike
            problem = ("nested too deeply" if isinstance(e, RecursionError)
                       else f"{type(e).__name__}: {e.msg}")
            raise TokenizerError(directory, f"chat template does not compile ({problem})") \
                from None
        return self._compiled

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation rendered as the model was trained to read it (a string, not yet encoded)."""
        import jinja2

        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Iterable):
            raise TypeError(f"apply_chat_template: messages must be a list of dicts (role, "
                            f"content), got {type(messages).__name__}")
        messages = list(messages)
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise TypeError(f"apply_chat_template: message {i} must be a dict (role, "
                                f"content), got {type(m).__name__}")
        template = self._template()
        # As transformers does: a None value means an absent key (OpenAI-style content=None).
        chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        try:
            with _time_limit(self.directory, RENDER_LIMIT_S):
                # transformers renders with tools and documents None when none are given
                return template.render(messages=chat, add_generation_prompt=add_generation_prompt,
                                       tools=None, documents=None, **self._special)
        except TokenizerError:
            raise  # the template's raise_exception: its own message
        except jinja2.TemplateError as e:
            raise TokenizerError(self.directory, f"chat template failed ({e})") from e
        except (ArithmeticError, TypeError, ValueError, LookupError, AttributeError,
                RecursionError) as e:  # the template's own expression failed as Python
            raise TokenizerError(self.directory, "chat template failed "
                                 f"({type(e).__name__}: {e})") from e

    def encode_prompt(self, prompt: str, chat: bool | None = None) -> list[int]:
        """Token ids for one user prompt; `chat` None means: through the chat template when there is one."""
        if not isinstance(prompt, str):  # (None rendered as a message without content)
            raise TypeError(f"encode_prompt: the prompt must be a str, got {type(prompt).__name__}")
        if chat is None:
            chat = self.has_chat_template
        if not chat:
            return self.encode(prompt)
        text = self.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        # The rendered template already holds every special token the model expects; adding them again
        # (a BOS post-processor, say) would double them.
        return self.encode(text, add_special_tokens=False)
