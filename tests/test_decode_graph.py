"""Width buckets of the D graphs (pure host logic; capture itself is a GPU test)."""

from colo_rollout.worker.decode_graph import MIN_WIDTH, width_bucket, width_buckets


def test_width_bucket_is_the_next_power_of_two_capped():
    assert width_bucket(1, 256) == MIN_WIDTH
    assert width_bucket(5, 256) == 8
    assert width_bucket(32, 256) == 32
    assert width_bucket(33, 256) == 64
    assert width_bucket(300, 256) == 256
    assert width_bucket(100, 96) == 96  # the cap need not be a power of two


def test_width_buckets_cover_every_table_length():
    assert width_buckets(25, 256) == [4, 8, 16, 32]
    assert width_buckets(1, 256) == [4]
    assert width_buckets(0, 256) == [4]
    assert width_buckets(200, 96) == [4, 8, 16, 32, 64, 96]
    for limit in (3, 17, 64, 65):
        ws = width_buckets(limit, 128)
        assert all(width_bucket(b, 128) in ws for b in range(1, limit + 1))
        assert ws == sorted(set(ws))
