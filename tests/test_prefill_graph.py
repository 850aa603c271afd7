"""Token buckets of P's MoE graphs (pure host logic; capture and replay are GPU tests in
tests/test_gpu.py, padded expert rows a CPU test in tests/test_engine.py)."""

from __future__ import annotations

import pytest

from colo_rollout.worker.prefill_graph import MIN_TOKENS, token_bucket, token_buckets


@pytest.mark.parametrize("cap", [32, 100, 1000, 16384])
def test_every_count_gets_the_smallest_bucket_that_holds_it(cap):
    buckets = token_buckets(cap)
    assert buckets == sorted(set(buckets)) and buckets[-1] == cap
    for n in range(1, cap + 1):
        b = token_bucket(n, cap)
        assert b in buckets and b >= n
        smaller = [x for x in buckets if x < b]
        assert not smaller or smaller[-1] < n  # no smaller bucket would hold n
        if n > MIN_TOKENS and b < cap:
            assert b <= 1.5 * n  # padding at most half the rows


def test_two_buckets_per_octave():
    assert token_buckets(1024) == [32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]


def test_count_over_capacity_is_refused():
    with pytest.raises(ValueError, match="1001 P tokens exceed"):
        token_bucket(1001, 1000)
