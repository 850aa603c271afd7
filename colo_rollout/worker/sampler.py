"""Token sampling from full-vocabulary logits: greedy, temperature, top-k, top-p; logprobs.

Owns the math only. Runs on the replica leader's device; the engine's control plane shares the
result with every rank. ``logprob`` is log p(token) under the unmodified model distribution
(temperature 1, no truncation) -- what an RL trainer recomputes -- or, for a sampled row with
``tempered_logprobs``, under the distribution it was drawn from before truncation,
log_softmax(logits / temperature) (a trainer that divides its logits by the rollout
temperature: the RL loop's).

Random draws use the exponential-race form of categorical sampling (argmax of p / Exp(1)) with
one seeded generator per engine, so a run is reproducible for a fixed request order, layout and
engine mode: the draws follow the order P and D steps take, which the mode decides (Normal,
Fine and the Global modes draw other sampled streams from one seed; greedy tokens are the same
in every mode).

A D iteration's rows are drawn one of three ways (``Draw``, decided by ``draw_for``):
greedy rows by argmax; rows with a temperature and nothing else (top-k off, top-p 1) by
``temperature_tensors``; rows with a truncation too by ``truncated_tensors`` (a sort of every
row). Both take their per-row parameters as tensors, have fixed shapes and read no host value:
what a D graph captures (worker/decode_graph.py), and what D runs without graphs too, so a
seed draws the same tokens either way. P's first tokens are drawn by ``sample_tensors``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import torch

from colo_rollout.model import greedy_pick
from colo_rollout.sched.request import SamplingParams
from colo_rollout.runtime.device import h2d


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generator: torch.Generator | None) -> tuple[list[int], list[float]]:
    """logits [n, V] -> (tokens, logprobs) for each row."""
    tokens, logprobs = sample_tensors(logits, params, generator)
    return tokens.tolist(), logprobs.tolist()


def sample_tensors(logits: torch.Tensor, params: list[SamplingParams],
                   generator: torch.Generator | None,
                   kind: Draw | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample`` left on the device (no host wait): tokens [n] int64, logprobs [n] fp32 for
    every row of ``logits`` [n, V]; rows past ``params`` (padding) are greedy. The draw the
    rows need (``draw_for``; ``kind``: one that covers them, decided by the caller), by the
    same ops as the D graphs' draw graphs."""
    kind = kind or draw_for(params)
    if kind is Draw.GREEDY:
        return greedy_tensors(logits)
    rows = logits.shape[0]
    table = h2d(draw_params(params, rows), torch.float32, logits.device).view(3, rows)
    lpt = (h2d(logprob_temperatures(params, rows), torch.float32, logits.device)
           if any(p.logprob_temperature != 1.0 for p in params) else None)
    return draw_tensors(kind, logits, table, generator, lpt)


class Draw(enum.Enum):
    """How a D iteration's rows are sampled (``draw_for``)."""

    GREEDY = "greedy"  # every row argmax: inside the D graph itself
    TEMPERATURE = "temperature"  # greedy or temperature-only rows: ``temperature_tensors``
    TRUNCATED = "truncated"  # some row has top-k or top-p: ``truncated_tensors``


def draw_for(params: Iterable[SamplingParams]) -> Draw:
    """The draw of a set of rows: the least capable kind that covers every row. A caller
    whose draw involves collectives (an MTP pass after the draw) passes every replica's rows,
    so that every rank takes the same path."""
    kind = Draw.GREEDY
    for p in params:
        if p.greedy:
            continue
        if p.top_k > 0 or p.top_p < 1.0:
            return Draw.TRUNCATED
        kind = Draw.TEMPERATURE
    return kind


def _tempered(logits: torch.Tensor, temperature: torch.Tensor,
              logprob_temperature: torch.Tensor | None = None):
    """(logprobs [n, V] of the unmodified distribution -- or, with ``logprob_temperature``
    [n], of logits / it per row (1: the unmodified one, bit for bit) --, greedy tokens [n],
    rows that draw [n], the tempered logits [n, V]). Shifted by the row max first: (x - max)
    / T stays finite-or--inf for any T > 0, so a tiny temperature tends to greedy instead of
    NaN."""
    logits = logits.float()
    hot = temperature > 0
    t = torch.where(hot, temperature, torch.ones_like(temperature))[:, None]
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    sub = shifted / t
    x = logits
    if logprob_temperature is not None:
        # the shifted logits too (found by probing: logits / 1e-38 overflowed to inf and the
        # logprob was NaN, reported as non-finite weights); rows at 1 keep the plain logits,
        # bit for bit, and so do rows whose temperature is 0 in fp32 (1e-46: drawn greedily,
        # reported as greedy rows are)
        lpt = logprob_temperature[:, None]
        x = torch.where((lpt == 1.0) | (lpt <= 0.0), logits, shifted / lpt)
    return torch.log_softmax(x, dim=-1), logits.argmax(dim=-1), hot, sub


def _race(logp, greedy, hot, sub, generator):
    """The exponential race over softmax(sub) for the rows that draw, argmax for the rest;
    noise is drawn for every row, so the random stream advances by the shape alone."""
    probs = torch.softmax(sub, dim=-1)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    tokens = torch.where(hot, (probs / noise).argmax(dim=-1), greedy)
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def temperature_tensors(logits: torch.Tensor, temperature: torch.Tensor,
                        generator: torch.Generator | None,
                        logprob_temperature: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row of ``logits`` [n, V] drawn at its ``temperature`` [n] (fp32 on the logits'
    device; 0 = greedy, the row's argmax bit for bit as ``greedy_tensors``): tokens [n] int64,
    logprobs [n] fp32 under the unmodified distribution. Fixed shapes and no host read, so a
    CUDA graph can capture it; noise is drawn for every row (greedy ones too), so the random
    stream advances by the same amount for a given n whichever rows are greedy.
    ``logprob_temperature`` [n]: each row's logprob at that temperature (``_tempered``)."""
    return _race(*_tempered(logits, temperature, logprob_temperature), generator)


def truncated_tensors(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, generator: torch.Generator | None,
                      logprob_temperature: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``temperature_tensors`` with each row's top-k (``top_k`` [n] int64, 0 = off) and then
    nucleus (``top_p`` [n] fp32, 1 = off) truncation of its tempered distribution -- a row
    keeps the logits >= its k-th largest, then drops a token when the mass strictly before it
    already reaches top_p (keeping >= 1) -- as tensor ops over a sort of every row:
    graph-capturable. Greedy rows are their argmax bit for bit."""
    logp, greedy, hot, sub = _tempered(logits, temperature, logprob_temperature)
    V = sub.shape[-1]
    ordered, order = sub.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).clamp(max=V)
    kth = ordered.gather(1, (k - 1)[:, None])
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))  # still in descending order
    probs = ordered.softmax(dim=-1)
    cum = probs.cumsum(dim=-1)
    drop_sorted = ((cum - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return _race(logp, greedy, hot, sub.masked_fill((sub < kth) | drop, float("-inf")),
                 generator)


def draw_tensors(kind: Draw, logits: torch.Tensor, params: torch.Tensor,
                 generator: torch.Generator | None,
                 logprob_temperature: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A TEMPERATURE or TRUNCATED draw of ``logits`` [n, V] from ``params`` [3, n] fp32 (rows:
    temperature, top_k, top_p; ``draw_params`` makes it): what the D graphs' draw graphs and
    eager D both run. ``logprob_temperature`` [n] fp32 (``logprob_temperatures`` makes it;
    None: every row's logprob of the unmodified distribution)."""
    if kind is Draw.TEMPERATURE:
        return temperature_tensors(logits, params[0], generator, logprob_temperature)
    if kind is Draw.TRUNCATED:
        return truncated_tensors(logits, params[0], params[1].long(), params[2], generator,
                                 logprob_temperature)
    raise ValueError(f"no tensor draw for {kind}")


def logprob_temperatures(params: list[SamplingParams], rows: int) -> list[float]:
    """Each row's ``SamplingParams.logprob_temperature`` (rows past ``params``: 1)."""
    return [p.logprob_temperature for p in params] + [1.0] * (rows - len(params))


TOP_P_FLOOR = 1.1754943508222875e-38  # fp32's least normal number


def draw_params(params: list[SamplingParams], rows: int) -> list[float]:
    """The flat [3, rows] host values of ``draw_tensors``'s parameters: each row's
    temperature, top_k, top_p; rows past ``params`` greedy (padding)."""
    pad = rows - len(params)
    # top_p at least fp32's least normal: a smaller one (valid: it is > 0) would round to 0
    # in the fp32 table and mask every token; at the floor the top token alone is kept
    return ([float(p.temperature) for p in params] + [0.0] * pad
            + [float(p.top_k) for p in params] + [0.0] * pad
            + [max(float(p.top_p), TOP_P_FLOOR) for p in params] + [1.0] * pad)


def greedy_tensors(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens [n] and their logprobs [n] of every row: what ``sample_tensors`` returns
    for all-greedy params (a D graph captures it with the forward). On CUDA one split
    reduction (model/greedy_pick.py: the same tokens; the logprobs torch's up to the sum's
    rounding order) instead of a [n, V] log_softmax."""
    if logits.is_cuda and greedy_pick.supports(logits):
        return greedy_pick.pick(logits)
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    return tokens, torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
