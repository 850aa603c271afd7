"""Configuration errors and the field checks every section uses.

Owns ``ConfigError`` (message = source file, dotted key, detail) and the helpers that check a
frozen dataclass's fields against their annotations and value rules. No YAML here.
"""

import dataclasses
import math
import reprlib
import types
import typing
from typing import Any


class ConfigError(ValueError):
    """An invalid configuration.

    The message names the source (file path or ``"<dict>"``) when known and the
    dotted key of the offending setting; both are also kept as attributes.
    """

    user_facing = True  # raised on a rank: the command's one error line (runtime/spawn.py)

    def __init__(self, message: str, *, key: str | None = None, source: str | None = None):
        super().__init__(message)
        self.key = key  # dotted key of the offending setting, when there is one
        self.source = source  # file path (or "<dict>") the setting came from, when known

    def __reduce__(self):
        # Keep key/source across pickling (errors may cross process boundaries).
        return (_rebuild_config_error, (str(self), self.key, self.source))


def _rebuild_config_error(message: str, key: str | None, source: str | None) -> ConfigError:
    return ConfigError(message, key=key, source=source)


def _error(key: str, detail: str) -> ConfigError:
    """A ConfigError for ``key`` (dotted) with the standard ``key: detail`` message."""
    return ConfigError(f"{key}: {detail}" if key else detail, key=key or None)


def _with_source(err: ConfigError, source: str) -> ConfigError:
    """The same error with ``source: `` prefixed to the message."""
    return ConfigError(f"{source}: {err}", key=err.key, source=source)


# --------------------------------------------------------------------------- #
# Generic type checking (driven by the dataclass annotations)
# --------------------------------------------------------------------------- #


def _type_name(tp: Any) -> str:
    """Human-readable name of an annotation, for error messages."""
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arm) for arm in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp)
        return f"list of {_type_name(item)}"
    return getattr(tp, "__name__", str(tp))


# error messages quote a user's value through this bounded repr: a YAML value of nested
# aliases is small on disk and in memory (shared references) but its full repr grows by the
# alias fan-out per level (six levels of ten: a 52 MB message)
_SHORT = reprlib.Repr(maxlevel=2, maxtuple=6, maxlist=6, maxdict=6, maxset=6, maxstring=80,
                      maxother=80, maxlong=40)


def _short(value: Any) -> str:
    """A repr of ``value`` cut to a few lines' worth (nested containers elided with ...)."""
    return _SHORT.repr(value)


def _key_text(key: Any) -> str:
    """A user's key as it appears in a dotted key of a message, cut in the middle past 80
    characters: YAML bounds a plain key at 1024 characters, but an explicit one (``? KEY``) or
    a ``--set`` key has no bound (found by probing: a 2 MB key was a 2 MB error line)."""
    text = str(key)
    if not text:  # (an empty key, `"": 5`, was a message with no key at all)
        return '""'
    return text if len(text) <= 80 else f"{text[:38]}...{text[-38:]}"


def _describe(value: Any) -> str:
    """``<type> <repr>`` of a value, for error messages (repr bounded: ``_short``)."""
    return f"{type(value).__name__} {_short(value)}"


# the largest magnitude of an int setting: what torch and numpy hold (int64); every check after
# the types may then compute with it in floats
MAX_INT = 2**63 - 1


def _check_value(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; return it normalised.

    Normalisation: an int given for a float field becomes a float (inf and nan are refused:
    no setting means them), and a list
    (or tuple) for a ``list[...]`` field becomes a fresh list.  bool is never
    accepted where an int or float is expected.
    """
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        arms = typing.get_args(tp)
        if value is None and type(None) in arms:
            return None
        others = [arm for arm in arms if arm is not type(None)]
        if len(others) == 1:
            try:
                return _check_value(value, others[0], key)
            except ConfigError:
                pass
        raise _error(key, f"expected {_type_name(tp)}, got {_describe(value)}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise _error(key, f"expected {_type_name(tp)}, got {_describe(value)}")
        return [_check_value(item, item_tp, f"{key}[{i}]") for i, item in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -MAX_INT <= value <= MAX_INT:  # (found by probing: a 400-digit count was
                # an OverflowError traceback in the door's float arithmetic)
                raise _error(key, f"{_short(value)} is out of range: a setting is a 64-bit "
                                  "integer (at most 2**63 - 1 in size)")
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                value = float(value)
            except OverflowError:  # an int too large for a float
                raise _error(key, f"must be a finite number, got {_short(value)}") from None
            if not math.isfinite(value):  # YAML .inf / .nan: no setting means them
                raise _error(key, f"must be a finite number, got {_short(value)}")
            return value
        if isinstance(value, str) and _parses_as_float(value):
            if not math.isfinite(float(value)):  # 'nan', 'inf': no setting means them
                raise _error(key, f"must be a finite number, got {_short(value)}")
            raise _error(
                key,
                f"expected float, got str {value!r} (YAML reads exponents without a "
                f"dot as strings; write e.g. 1.0e+6)",
            )
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, bool):
            raise _error(
                key,
                f"expected str, got bool {value!r} (YAML reads unquoted on/off/yes/no/true/false "
                f"as booleans; quote the value, e.g. 'off')",
            )
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
    else:  # pragma: no cover - guards against an unsupported annotation in this module
        raise TypeError(f"config.py: unsupported field annotation {tp!r} for {key}")
    raise _error(key, f"expected {_type_name(tp)}, got {_describe(value)}")


def _parses_as_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_field_types(obj: Any) -> None:
    """Type-check and normalise every field of a config dataclass instance in place.

    Called first in each ``__post_init__`` so later checks can rely on types.
    Keys in messages are ``<section>.<field>`` using the class's ``SECTION``.
    """
    hints = typing.get_type_hints(type(obj))
    section = type(obj).SECTION
    for f in dataclasses.fields(obj):
        key = f"{section}.{f.name}" if section else f.name
        value = getattr(obj, f.name)
        normalised = _check_value(value, hints[f.name], key)
        if normalised is not value:
            object.__setattr__(obj, f.name, normalised)


def _require(cond: bool, key: str, detail: str) -> None:
    if not cond:
        raise _error(key, detail)


def _require_min(obj: Any, names: tuple[str, ...], minimum: int) -> None:
    """Each named int field of ``obj`` must be ``>= minimum``."""
    for name in names:
        value = getattr(obj, name)
        _require(value >= minimum, f"{obj.SECTION}.{name}", f"must be >= {minimum}, got {value}")


# a seed's largest value: 32 bits (the engine derives per-replica generator seeds from it by
# seed * 1_000_003 + replica, which must stay in torch's int64)
MAX_SEED = 2 ** 32 - 1


def _require_seed(obj: Any) -> None:
    """``obj.seed`` is in [0, MAX_SEED]."""
    value = obj.seed
    _require(0 <= value <= MAX_SEED, f"{obj.SECTION}.seed",
             f"must be in [0, {MAX_SEED}], got {_short(value)}")


def _require_choice(obj: Any, name: str, choices: tuple[Any, ...]) -> None:
    value = getattr(obj, name)
    _require(
        value in choices,
        f"{obj.SECTION}.{name}",
        f"expected one of {', '.join('null' if c is None else repr(c) for c in choices)}; "
        f"got {_short(value)}",
    )
