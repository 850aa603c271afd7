"""NCCL's launch ordering across communicators (runtime/nccl_env.py): set from NCCL 2.26 on,
never over a value the user set, nothing on older NCCL or without NCCL."""

from __future__ import annotations

from colo_rollout.runtime import nccl_env as ne


def test_launch_order_from_nccl_2_26():
    want = {"NCCL_LAUNCH_ORDER_IMPLICIT": "1", "NCCL_LAUNCH_RACE_FATAL": "1"}
    assert ne.nccl_env((2, 28, 9), {}) == want
    assert ne.nccl_env((2, 26, 0), {"PATH": "/bin"}) == want
    assert ne.nccl_env((3, 0, 1), {}) == want
    assert ne.nccl_env((2, 25, 1), {}) == {}
    assert ne.nccl_env(None, {}) == {}


def test_a_users_value_is_kept():
    got = ne.nccl_env((2, 28, 9), {"NCCL_LAUNCH_ORDER_IMPLICIT": "0"})
    assert got == {"NCCL_LAUNCH_RACE_FATAL": "1"}


def test_apply_sets_only_what_this_nccl_takes(monkeypatch):
    env = {"NCCL_LAUNCH_RACE_FATAL": "0"}
    monkeypatch.setattr(ne, "nccl_version", lambda: (2, 28, 9))
    assert ne.apply_nccl_env(env) == {"NCCL_LAUNCH_ORDER_IMPLICIT": "1"}
    assert env == {"NCCL_LAUNCH_RACE_FATAL": "0", "NCCL_LAUNCH_ORDER_IMPLICIT": "1"}
    monkeypatch.setattr(ne, "nccl_version", lambda: None)  # no NCCL (this CPU host)
    env = {}
    assert ne.apply_nccl_env(env) == {} and env == {}
