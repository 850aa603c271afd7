"""Unit tests for colo_rollout.worker.sampler.sample (CPU torch; no processes)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from colo_rollout.sched.request import SamplingParams
from colo_rollout.worker.sampler import sample


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def repeat(row: list[float], n: int) -> torch.Tensor:
    return torch.tensor([row], dtype=torch.float32).repeat(n, 1)


def counts(tokens: list[int], vocab: int) -> list[int]:
    c = Counter(tokens)
    return [c.get(i, 0) for i in range(vocab)]


def softmax64(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    z = sum(e)
    return [v / z for v in e]


def assert_frequencies(tokens: list[int], probs: list[float], sigmas: float = 4.5) -> None:
    """Per-bin binomial check: |count - n p| <= sigmas * sqrt(n p (1 - p)) (+1 for p ~ 0)."""
    n = len(tokens)
    got = counts(tokens, len(probs))
    for i, (c, p) in enumerate(zip(got, probs)):
        tol = sigmas * math.sqrt(n * p * (1 - p)) + 1
        assert abs(c - n * p) <= tol, f"id {i}: {c} draws, expected {n * p:.1f} +- {tol:.1f}"


# the distribution [0.5, 0.3, 0.15, 0.05] as logits (plus an arbitrary shift)
P4 = [0.5, 0.3, 0.15, 0.05]
L4 = [math.log(p) + 1.7 for p in P4]


# --------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_with_log_softmax_logprob() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 37) * 3
    toks, lps = sample(logits, [SamplingParams()] * 16, gen())
    assert toks == logits.argmax(dim=-1).tolist()
    ref = torch.log_softmax(logits.double(), dim=-1)
    for i, (t, lp) in enumerate(zip(toks, lps)):
        assert isinstance(t, int)
        assert lp == pytest.approx(ref[i, t].item(), abs=1e-5)
        assert lp <= 0


def test_greedy_accepts_low_precision_logits() -> None:
    torch.manual_seed(1)
    logits = (torch.randn(4, 11) * 2).to(torch.bfloat16)
    toks, lps = sample(logits, [SamplingParams()] * 4, None)
    assert toks == logits.float().argmax(dim=-1).tolist()
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert lps == pytest.approx([ref[i, t].item() for i, t in enumerate(toks)], abs=1e-4)


def test_greedy_rows_unaffected_by_random_rows_in_same_batch() -> None:
    torch.manual_seed(2)
    logits = torch.randn(10, 9)
    params = [SamplingParams(temperature=1.5 if i % 2 else 0.0) for i in range(10)]
    toks, _ = sample(logits, params, gen(3))
    am = logits.argmax(dim=-1).tolist()
    assert [t for i, t in enumerate(toks) if i % 2 == 0] == [a for i, a in enumerate(am) if i % 2 == 0]


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_1_equals_greedy(temperature: float) -> None:
    torch.manual_seed(4)
    logits = torch.randn(200, 23)
    toks, lps = sample(logits, [SamplingParams(temperature=temperature, top_k=1)] * 200, gen(5))
    assert toks == logits.argmax(dim=-1).tolist()
    greedy_toks, greedy_lps = sample(logits, [SamplingParams()] * 200, gen(5))
    assert toks == greedy_toks and lps == pytest.approx(greedy_lps)


# --------------------------------------------------------------------------- truncation


@pytest.mark.parametrize("k", [2, 3, 5])
def test_top_k_restricts_to_top_k_ids(k: int) -> None:
    row = [0.3, 2.0, -1.0, 1.5, 0.9, 1.8, -0.2, 0.0]  # nearly flat: every id is likely at T=2
    n = 2000
    toks, _ = sample(repeat(row, n), [SamplingParams(temperature=2.0, top_k=k)] * n, gen(k))
    allowed = set(sorted(range(len(row)), key=lambda i: -row[i])[:k])
    assert set(toks) == allowed  # only the top k, and all of them show up
    # within the kept ids, frequencies follow the renormalised softmax(logits / T)
    sub = softmax64([row[i] / 2.0 if i in allowed else -math.inf for i in range(len(row))])
    assert_frequencies(toks, sub)


@pytest.mark.parametrize("top_p,kept", [
    (0.45, {0}),            # 0.5 alone reaches 0.45
    (0.7, {0, 1}),          # 0.5 < 0.7 <= 0.8
    (0.85, {0, 1, 2}),      # 0.8 < 0.85 <= 0.95
    (0.99, {0, 1, 2, 3}),
])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p: float, kept: set[int]) -> None:
    n = 4000
    toks, _ = sample(repeat(L4, n), [SamplingParams(temperature=1.0, top_p=top_p)] * n, gen(11))
    assert set(toks) == kept
    mass = sum(P4[i] for i in kept)
    assert_frequencies(toks, [P4[i] / mass if i in kept else 0.0 for i in range(4)])


def test_top_p_applies_to_unsorted_vocab_order() -> None:
    # the same distribution permuted: ids by probability are 2 (0.5), 0 (0.3), 3 (0.15), 1 (0.05)
    perm_logits = [L4[1], L4[3], L4[0], L4[2]]
    n = 2000
    toks, _ = sample(repeat(perm_logits, n), [SamplingParams(temperature=1.0, top_p=0.7)] * n,
                     gen(12))
    assert set(toks) == {2, 0}


def test_top_k_and_top_p_combined() -> None:
    # top_k=3 keeps {0,1,2} with mass 0.95 -> renormalised [0.526, 0.316, 0.158];
    # top_p 0.6 then keeps the prefix {0, 1} (0.526 < 0.6 <= 0.842)
    n = 3000
    toks, _ = sample(repeat(L4, n), [SamplingParams(temperature=1.0, top_k=3, top_p=0.6)] * n,
                     gen(13))
    assert set(toks) == {0, 1}
    assert_frequencies(toks, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])


def test_per_row_parameters_are_independent() -> None:
    n = 1500
    logits = repeat(L4, 2 * n)
    params = [SamplingParams(temperature=1.0, top_k=1)] * n + [SamplingParams(temperature=1.0)] * n
    toks, _ = sample(logits, params, gen(14))
    assert set(toks[:n]) == {0}
    assert set(toks[n:]) == {0, 1, 2, 3}  # the untruncated rows see the whole vocabulary
    assert_frequencies(toks[n:], P4)


# --------------------------------------------------------------------------- temperature


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_temperature_frequencies_match_softmax(temperature: float) -> None:
    row = [1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.25]
    n = 20000
    toks, _ = sample(repeat(row, n), [SamplingParams(temperature=temperature)] * n,
                     gen(int(temperature * 10)))
    want = softmax64([x / temperature for x in row])
    assert_frequencies(toks, want)
    # chi-square as well (df = 6; 99.99th percentile ~ 27.9)
    got = counts(toks, len(row))
    chi2 = sum((c - n * p) ** 2 / (n * p) for c, p in zip(got, want))
    assert chi2 < 27.9, chi2


def test_temperature_actually_changes_the_distribution() -> None:
    # guards against the frequency test passing for a sampler that ignores T
    row = [1.0, 0.0, -1.0]
    n = 20000
    toks, _ = sample(repeat(row, n), [SamplingParams(temperature=0.25)] * n, gen(21))
    p_t1 = softmax64(row)[0]
    p_t = softmax64([x / 0.25 for x in row])[0]
    frac0 = toks.count(0) / n
    assert abs(frac0 - p_t) < 0.02 and abs(frac0 - p_t1) > 0.2


# --------------------------------------------------------------------------- reproducibility


def test_same_seed_same_samples_different_seed_differs() -> None:
    torch.manual_seed(6)
    logits = torch.randn(500, 30)
    params = [SamplingParams(temperature=1.3, top_k=10 * (i % 3), top_p=0.5 + 0.25 * (i % 3))
              for i in range(500)]
    a = sample(logits, params, gen(99))
    b = sample(logits, params, gen(99))
    c = sample(logits, params, gen(100))
    assert a == b
    assert a[0] != c[0]


def test_generator_is_advanced_between_calls() -> None:
    logits = repeat([0.0] * 16, 200)
    params = [SamplingParams(temperature=1.0)] * 200
    g = gen(5)
    first, _ = sample(logits, params, g)
    second, _ = sample(logits, params, g)
    assert first != second
    again, _ = sample(logits, params, gen(5))
    assert again == first


# --------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.4),
    SamplingParams(temperature=2.0, top_k=3),
    SamplingParams(temperature=0.7, top_p=0.6),
    SamplingParams(temperature=1.5, top_k=5, top_p=0.8),
])
def test_logprob_is_under_unmodified_distribution(params: SamplingParams) -> None:
    torch.manual_seed(7)
    logits = torch.randn(300, 17) * 2
    toks, lps = sample(logits, [params] * 300, gen(8))
    ref = torch.log_softmax(logits.double(), dim=-1)  # T = 1, no truncation
    want = [ref[i, t].item() for i, t in enumerate(toks)]
    assert lps == pytest.approx(want, abs=1e-5)
    # and it is NOT the log-probability under the modified distribution
    mod = torch.log_softmax(logits.double() / params.temperature, dim=-1)
    assert max(abs(lp - mod[i, t].item()) for i, (t, lp) in enumerate(zip(toks, lps))) > 1e-2


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.4, tempered_logprobs=True),
    SamplingParams(temperature=2.0, top_k=3, tempered_logprobs=True),
    SamplingParams(temperature=0.7, top_p=0.6, tempered_logprobs=True),
])
def test_tempered_logprobs_are_of_the_distribution_drawn_from(params: SamplingParams) -> None:
    """``tempered_logprobs``: log_softmax(logits / T) of the sampled token (before top-k /
    top-p), what a trainer dividing its logits by the rollout temperature recomputes; rows
    without it in the same batch keep the model's own logprobs bit for bit, and the tokens
    drawn are the same either way (the flag changes what is reported, not the draw)."""
    torch.manual_seed(7)
    logits = torch.randn(300, 17) * 2
    plain = SamplingParams(temperature=params.temperature, top_k=params.top_k,
                           top_p=params.top_p)
    mixed = [params if i % 2 == 0 else plain for i in range(300)]
    toks, lps = sample(logits, mixed, gen(8))
    toks_plain, lps_plain = sample(logits, [plain] * 300, gen(8))
    assert toks == toks_plain
    mod = torch.log_softmax(logits.double() / params.temperature, dim=-1)
    for i, (t, lp) in enumerate(zip(toks, lps)):
        if i % 2 == 0:
            assert lp == pytest.approx(mod[i, t].item(), abs=1e-5), i
        else:
            assert lp == lps_plain[i], i  # bit for bit


def test_tempered_logprobs_leave_greedy_rows_and_the_d_graph_draw_alike() -> None:
    """A greedy row with the flag is the model's own logprob (its temperature is 0); the
    D graphs' draw (``draw_tensors`` with the per-row ``logprob_temperatures`` buffer, ones
    where unset) gives the eager sampler's tokens and logprobs."""
    from colo_rollout.worker.sampler import (Draw, draw_params, draw_tensors,
                                             logprob_temperatures)

    torch.manual_seed(3)
    logits = torch.randn(6, 17) * 2
    params = [SamplingParams(temperature=0.0, tempered_logprobs=True),
              SamplingParams(temperature=0.5, tempered_logprobs=True),
              SamplingParams(temperature=0.5), SamplingParams(temperature=1.3, top_k=4,
                                                              tempered_logprobs=True)]
    assert [p.logprob_temperature for p in params] == [1.0, 0.5, 1.0, 1.3]
    table = torch.tensor(draw_params(params, 6), dtype=torch.float32).view(3, 6)
    lpt = torch.tensor(logprob_temperatures(params, 6), dtype=torch.float32)
    assert lpt.tolist() == [1.0, 0.5, 1.0, pytest.approx(1.3), 1.0, 1.0]
    toks, lps = draw_tensors(Draw.TRUNCATED, logits, table, gen(4), lpt)
    etoks, elps = sample(logits, params + [SamplingParams()] * 2, gen(4))
    assert toks.tolist() == etoks and lps.tolist() == elps
    ref = torch.log_softmax(logits, dim=-1)
    assert lps[0].item() == ref[0, toks[0]].item() and toks[0] == logits[0].argmax()
    # ones everywhere: exactly the draw without the buffer (division by 1 is exact)
    ones = torch.ones(6)
    a = draw_tensors(Draw.TEMPERATURE, logits, table, gen(5), ones)
    b = draw_tensors(Draw.TEMPERATURE, logits, table, gen(5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("t", [1e-38, 1e-40, 1e-46])
def test_a_tiny_temperatures_tempered_logprob_stays_finite(t: float) -> None:
    """logits / 1e-38 overflowed to inf and the tempered logprob was NaN (found by probing:
    the request ended as 'the model's logits are not finite'): the shifted logits are divided,
    so the drawn token -- the argmax at such a temperature -- has logprob 0 (1e-46 is 0 in
    fp32: drawn greedily and reported as a greedy row, at T = 1)."""
    logits = torch.tensor([[40.0, 3.0, -7.0, 39.5]])
    toks, lps = sample(logits, [SamplingParams(temperature=t, tempered_logprobs=True)], gen(1))
    want = torch.log_softmax(logits, -1)[0, 0].item() if t < 1e-45 else 0.0
    assert toks == [0] and lps == [want]


def test_tempered_logprobs_cross_the_wire_and_are_validated() -> None:
    from colo_rollout.sched.request import RequestError

    p = SamplingParams(temperature=0.7, tempered_logprobs=True)
    assert SamplingParams.from_json(p.to_json()) == p
    old_wire = {k: v for k, v in p.to_json().items() if k != "tempered_logprobs"}
    assert SamplingParams.from_json(old_wire).tempered_logprobs is False
    with pytest.raises(RequestError, match="tempered_logprobs must be a bool"):
        SamplingParams(temperature=0.7, tempered_logprobs="yes").validate("r", 17)


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("top_k", [0, 2])
def test_tiny_temperature_is_greedy(top_k: int) -> None:
    # well-separated logits (gap 0.5): at T = 1e-40 any non-argmax id has probability
    # exp(-0.5 / 1e-40) == 0, so the only correct answer is the argmax
    torch.manual_seed(9)
    logits = torch.stack([torch.randperm(8).float() * 0.5 - 2.0 for _ in range(64)])
    params = [SamplingParams(temperature=1e-40, top_k=top_k)] * 64
    params[0].validate("tiny-t", 8)  # the engine accepts it
    toks, lps = sample(logits, params, gen(10))
    want = logits.argmax(dim=-1).tolist()
    wrong = sum(t != w for t, w in zip(toks, want))
    assert wrong == 0, f"{wrong}/64 rows not greedy; sampled ids {sorted(set(toks))}"
    assert not any(math.isnan(x) for x in lps)


def test_pending_sampled_unpacks_both_layouts():
    """A D graph's greedy rows come back as one [2, n] float64 (tokens, logprobs); eager
    sampling as two tensors. Both resolve to the same Sampled values, tokens as ints."""
    from colo_rollout.worker.runner import PendingSampled
    from colo_rollout.sched.plan import Sampled
    from colo_rollout.runtime.device import Pending

    tokens = torch.tensor([3, 70000])
    logprobs = torch.tensor([-0.5, -1.25], dtype=torch.float32)
    want = [Sampled(5, 3, -0.5), Sampled(7, 70000, -1.25)]
    pair = PendingSampled([5, 7], Pending(tokens, logprobs))
    packed = PendingSampled([5, 7], Pending(torch.stack([tokens.double(), logprobs.double()])),
                            packed=True)
    for p in (pair, packed):
        got = p.resolve()
        assert got == want and all(type(s.token) is int for s in got)


# --------------------------------------------------------------------------- in-graph draws


def test_draw_for_is_the_least_capable_kind_covering_every_row() -> None:
    from colo_rollout.worker.sampler import Draw, draw_for

    g, t = SamplingParams(), SamplingParams(temperature=0.7)
    assert draw_for([]) is Draw.GREEDY
    assert draw_for([g, g]) is Draw.GREEDY
    # top-k / top-p do nothing to a greedy row: still greedy
    assert draw_for([g, SamplingParams(top_k=5, top_p=0.5)]) is Draw.GREEDY
    assert draw_for([g, t]) is Draw.TEMPERATURE
    assert draw_for([t, SamplingParams(temperature=1.0, top_k=3)]) is Draw.TRUNCATED
    assert draw_for([SamplingParams(temperature=1.0, top_p=0.9), g]) is Draw.TRUNCATED


def test_temperature_draw_greedy_rows_are_argmax_bit_for_bit() -> None:
    from colo_rollout.worker.sampler import greedy_tensors, temperature_tensors

    torch.manual_seed(3)
    logits = torch.randn(6, 50) * 4
    temps = torch.tensor([0.0, 1.0, 0.0, 0.3, 0.0, 2.0])
    tokens, logprobs = temperature_tensors(logits, temps, gen(1))
    gt, glp = greedy_tensors(logits)
    for i in (0, 2, 4):
        assert tokens[i] == gt[i] and logprobs[i] == glp[i]
    # every logprob is the unmodified distribution's, whatever the temperature
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert torch.equal(logprobs, ref.gather(1, tokens[:, None])[:, 0])


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_draw_follows_softmax_of_logits_over_t(temperature: float) -> None:
    from colo_rollout.worker.sampler import temperature_tensors

    n = 20000
    tokens, _ = temperature_tensors(repeat(L4, n), torch.full((n,), temperature), gen(7))
    assert_frequencies(tokens.tolist(), softmax64([x / temperature for x in L4]))


def test_temperature_draw_matches_the_eager_sampler_in_distribution() -> None:
    """The draw graph's ops and sample_tensors draw from one distribution (different noise)."""
    from colo_rollout.worker.sampler import temperature_tensors

    n, T = 20000, 0.8
    a, _ = temperature_tensors(repeat(L4, n), torch.full((n,), T), gen(11))
    b, _ = sample(repeat(L4, n), [SamplingParams(temperature=T)] * n, gen(12))
    probs = softmax64([x / T for x in L4])
    assert_frequencies(a.tolist(), probs)
    assert_frequencies(b, probs)


def test_temperature_draw_advances_the_stream_by_the_shape_alone() -> None:
    """Noise is drawn for every row, greedy ones too: the generator ends at the same state for
    a given shape whichever rows are greedy (a graph's fixed RNG advance), and a seed repeats
    the draw."""
    from colo_rollout.worker.sampler import temperature_tensors

    torch.manual_seed(5)
    logits = torch.randn(4, 30)
    g1, g2 = gen(9), gen(9)
    a, _ = temperature_tensors(logits, torch.tensor([1.0, 0.0, 0.0, 0.0]), g1)
    temperature_tensors(logits, torch.tensor([0.0, 0.5, 1.0, 3.0]), g2)
    assert torch.equal(g1.get_state(), g2.get_state())
    again, _ = temperature_tensors(logits, torch.tensor([1.0, 0.0, 0.0, 0.0]), gen(9))
    assert torch.equal(a, again)


def test_temperature_draw_tiny_temperature_tends_to_greedy_without_nan() -> None:
    from colo_rollout.worker.sampler import temperature_tensors

    torch.manual_seed(8)
    logits = torch.randn(64, 40) * 3
    tokens, logprobs = temperature_tensors(logits, torch.full((64,), 1e-6), gen(2))
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert torch.isfinite(logprobs).all()


def _truncated(logits, temps, ks, ps, g):
    from colo_rollout.worker.sampler import truncated_tensors

    return truncated_tensors(logits, torch.tensor(temps, dtype=torch.float32),
                             torch.tensor(ks, dtype=torch.int64),
                             torch.tensor(ps, dtype=torch.float32), g)


@pytest.mark.parametrize("T,k,p", [(1.0, 2, 1.0), (1.0, 0, 0.7), (0.5, 3, 0.6), (2.0, 4, 1.0)])
def test_truncated_draw_follows_the_eager_samplers_truncation(T, k, p):
    """The draw graph's truncation (tensor ops over a sort) keeps sample_tensors' rules:
    top-k first, then the nucleus of what is left; frequencies of both within sampling noise
    of the truncated softmax."""
    n = 20000
    a, _ = _truncated(repeat(L4, n), [T] * n, [k] * n, [p] * n, gen(3))
    b, _ = sample(repeat(L4, n), [SamplingParams(temperature=T, top_k=k, top_p=p)] * n, gen(4))
    q = softmax64([x / T for x in L4])
    keep = list(range(k)) if k else list(range(4))  # L4 is in descending order
    z = sum(q[i] for i in keep)
    q = [q[i] / z if i in keep else 0.0 for i in range(4)]
    if p < 1.0:  # drop a token once the mass before it reaches p
        cum, kept = 0.0, []
        for i in range(4):
            if q[i] > 0 and cum < p:
                kept.append(i)
            cum += q[i]
        z = sum(q[i] for i in kept)
        q = [q[i] / z if i in kept else 0.0 for i in range(4)]
    assert_frequencies(a.tolist(), q)
    assert_frequencies(b, q)


def test_truncated_draw_mixes_greedy_plain_and_truncated_rows():
    torch.manual_seed(4)
    logits = torch.randn(5, 40) * 3
    tokens, logprobs = _truncated(logits, [0.0, 1.0, 1.0, 0.0, 0.7], [5, 0, 1, 0, 3],
                                  [0.5, 1.0, 1.0, 1.0, 0.9], gen(6))
    assert tokens[0] == logits[0].argmax() and tokens[3] == logits[3].argmax()  # greedy rows
    assert tokens[2] == logits[2].argmax()  # top-k 1: the argmax whatever the noise
    assert tokens[4] in logits[4].topk(3).indices  # within its top 3
    ref = torch.log_softmax(logits, dim=-1)
    assert torch.equal(logprobs, ref.gather(1, tokens[:, None])[:, 0])


def test_draw_params_layout_and_padding():
    from colo_rollout.worker.sampler import Draw, draw_params, draw_tensors

    ps = [SamplingParams(temperature=0.5, top_k=3, top_p=0.9), SamplingParams()]
    flat = draw_params(ps, 4)
    assert flat == [0.5, 0.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.9, 1.0, 1.0, 1.0]
    torch.manual_seed(1)
    logits = torch.randn(4, 16)
    table = torch.tensor(flat, dtype=torch.float32).view(3, 4)
    tokens, _ = draw_tensors(Draw.TRUNCATED, logits, table, gen(2))
    assert torch.equal(tokens[1:], logits[1:].argmax(dim=-1))  # greedy and padding rows
    with pytest.raises(ValueError, match="no tensor draw"):
        draw_tensors(Draw.GREEDY, logits, table, gen(2))
