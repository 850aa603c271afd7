"""What Transformer Engine can run on this host, asked without building anything.

Owns ``te_available`` (TE importable) and ``te_fp8_problem`` (why ``model.fp8_backend: te``
with a recipe cannot run here). The door asks them before any rank starts; the model build
asks again on each rank (model/model.py, model/fp8_te.py). TE is imported only when asked.
"""

from __future__ import annotations


def te_available() -> bool:
    """Whether Transformer Engine imports here."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken install (missing CUDA libraries)
        return False
    return True


TE_RECIPES = {"tensorwise": "Float8CurrentScaling", "blockwise": "Float8BlockScaling"}


def te_fp8_problem(recipe: str) -> str | None:
    """Why ``model.fp8_backend: te`` with ``recipe`` cannot run here (None: it can): TE's
    PyTorch package not importable, or its FP8 (or FP8 block-scaling) GEMMs not supported by
    this GPU / CUDA build (TE's own checks)."""
    if recipe not in TE_RECIPES:
        return (f"model.fp8_recipe {recipe!r} is not a Transformer Engine recipe here (one of "
                f"{', '.join(TE_RECIPES)})")
    try:
        from transformer_engine.pytorch import (is_fp8_available,
                                                is_fp8_block_scaling_available)
    except Exception as e:  # absent, or a broken install (missing CUDA libraries)
        return (f"Transformer Engine's PyTorch package is not importable here "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); install "
                "transformer-engine[pytorch] (the 'te' extra) or set model.fp8_backend: engine")
    check = is_fp8_block_scaling_available if recipe == "blockwise" else is_fp8_available
    ok, why = check(return_reason=True)
    if not ok:
        return (f"Transformer Engine cannot run {TE_RECIPES[recipe]} here: {why}; set "
                "model.fp8_backend: engine")
    return None


