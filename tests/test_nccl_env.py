"""NCCL's launch ordering across communicators (runtime/nccl_env.py): set from NCCL 2.26 on,
never over a value the user set, nothing on older NCCL or without NCCL."""

from __future__ import annotations

import torch

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


def test_torch_cudnn_is_loaded_first_only_where_te_is_installed(monkeypatch):
    """runtime/cudnn_env.py: with Transformer Engine installed, torch's cuDNN is loaded before
    TE's loader can pick a system one, and TE is pointed at torch's directory (CUDNN_PATH, a
    user's choice kept); without TE nothing is loaded -- this CPU host has no TE."""
    import colo_rollout.runtime.cudnn_env as ce

    assert ce.te_installed() is False and ce.load_torch_cudnn_first({}) == {}
    maps = ("7f00-7f01 r--p 00000000 08:01 11 /usr/lib/libc.so.6\n"
            "7f02-7f03 r-xp 00000000 08:01 12 /venv/nvidia/cudnn/lib/libcudnn.so.9\n"
            "7f04-7f05 rw-p 00000000 00:00 0 \n")
    assert ce.loaded_cudnn_dir(maps) == "/venv/nvidia/cudnn/lib"
    assert ce.loaded_cudnn_dir("7f04-7f05 rw-p 00000000 00:00 0 [heap]\n") is None
    assert ce.te_cudnn_env("/t/lib", {}) == {"CUDNN_PATH": "/t/lib"}
    assert ce.te_cudnn_env("/t/lib", {"CUDNN_PATH": "/mine"}) == {}
    assert ce.te_cudnn_env("/t/lib", {"CUDNN_HOME": "/mine"}) == {}
    assert ce.te_cudnn_env(None, {}) == {}
    monkeypatch.setattr(ce, "te_installed", lambda: True)
    loaded = []
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: loaded.append(1) or 91900)
    env = {}
    got = ce.load_torch_cudnn_first(env)
    assert loaded == [1] and got == env  # this process's map decides what is set
    def mismatch():
        raise RuntimeError("cuDNN version incompatibility: PyTorch was compiled against ...")

    monkeypatch.setattr(torch.backends.cudnn, "version", mismatch)  # TE imported first
    assert ce.load_torch_cudnn_first({}) == {}  # the import goes on; torch reports it at use
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    assert ce.load_torch_cudnn_first({}) == {} and loaded == [1]
