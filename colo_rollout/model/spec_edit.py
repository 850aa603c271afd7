"""Copies of megatron module specs with some slots replaced.

Owns ``replace_in_spec``: the one walk over a megatron spec (ModuleSpecs, the layer and block
``*Submodules`` dataclasses, partials, lists) that builds a copy in which a caller's function
replaced what it recognises -- megatron's own spec objects are never modified (its spec
builders may hand out shared ones). Used for the sequence-parallel torch norms
(model/megatron_gpt.py) and for MLA on the local spec (model/mla_core_attention.py).

Must not go in here: which slots to replace (the callers), building modules.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec


def replace_in_spec(spec: Any, replace: Callable[[Any], Any]) -> Any:
    """A copy of ``spec`` where every object for which ``replace(obj)`` returns something
    other than None is that result (not walked further); everything else is copied with its
    parts walked, or kept as it is (classes, values)."""

    def walk(obj):
        got = replace(obj)
        if got is not None:
            return got
        if isinstance(obj, (list, tuple)):
            return type(obj)(walk(o) for o in obj)
        if isinstance(obj, functools.partial):
            return functools.partial(walk(obj.func), *map(walk, obj.args),
                                     **{k: walk(v) for k, v in obj.keywords.items()})
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            if isinstance(obj, ModuleSpec) or type(obj).__name__.endswith("Submodules"):
                return dataclasses.replace(obj, **{f.name: walk(getattr(obj, f.name))
                                                   for f in dataclasses.fields(obj) if f.init})
        return obj

    return walk(spec)
