"""The weight sync's one-launch copy of many tensor pairs (rl/multi_copy.py), run by Triton's
CPU interpreter in a subprocess: every byte of every pair copied, nothing outside them
touched, the table rebuilt after the tensors moved; the pairs it refuses."""

from __future__ import annotations

import pytest
import torch

from tests.interpreted import HAS_TRITON, interpreted_main


def _interpreted() -> list[str]:
    from colo_rollout.rl import multi_copy as mc

    fails = []
    g = torch.Generator().manual_seed(0)
    cpu = ("cpu",)
    # sizes past one chunk, ragged ones, odd bf16 counts (2-byte units), one-byte tensors
    for dtype, sizes in ((torch.bfloat16, [1, 7, mc.CHUNK + 5, 2 * mc.CHUNK]),
                         (torch.float32, [3, 4096, 33]), (torch.uint8, [5, 1, 300])):
        src = [torch.randn(n, generator=g).to(dtype) if dtype != torch.uint8
               else torch.randint(0, 255, (n,), generator=g, dtype=dtype) for n in sizes]
        # destinations: views of one padded storage, guard elements between them untouched
        pad = 3
        store = torch.full((sum(sizes) + pad * (len(sizes) + 1),), 7).to(dtype)
        dst, at = [], pad
        for n in sizes:
            dst.append(store[at : at + n])
            at += n + pad
        copy = mc.MultiCopy(dst, src, devices=cpu)
        nbytes = copy.run()
        if nbytes != sum(s.numel() * s.element_size() for s in src):
            fails.append(f"{dtype}: {nbytes} bytes reported")
        if not all(torch.equal(d, s) for d, s in zip(dst, src)):
            fails.append(f"{dtype}: a pair was not copied exactly")
        guard = torch.ones_like(store, dtype=torch.bool)
        at = pad
        for n in sizes:
            guard[at : at + n] = False
            at += n + pad
        if not (store[guard] == torch.tensor(7).to(dtype)).all():
            fails.append(f"{dtype}: bytes outside the pairs changed")
    # the tensors move (a memory release and resume swaps .data): refresh, then copy again
    p = torch.nn.Parameter(torch.zeros(100))
    s = torch.randn(100, generator=g)
    copy = mc.MultiCopy([p], [s], devices=cpu)
    p.data = torch.zeros(100)
    copy.refresh()
    copy.run()
    if not torch.equal(p.data, s):
        fails.append("after refresh the moved parameter was not written")
    return fails


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_multi_copy_interpreted(interpreted):
    interpreted.check(__file__)


def test_multi_copy_refuses_what_it_cannot_copy():
    from colo_rollout.rl import multi_copy as mc

    a = torch.zeros(4)
    assert not mc.eligible(a, a)  # CPU tensors: CUDA only outside the tests
    assert not mc.eligible(a, a.double(), ("cpu",))
    assert not mc.eligible(a, torch.zeros(5), ("cpu",))
    assert not mc.eligible(torch.zeros(4, 4).t(), torch.zeros(4, 4), ("cpu",))
    with pytest.raises(ValueError, match="cannot copy"):
        mc.MultiCopy([a], [a.double()], devices=("cpu",))
    with pytest.raises(ValueError, match="matching"):
        mc.MultiCopy([], [])


if __name__ == "__main__":  # the interpreted run (the test above starts it)
    interpreted_main(_interpreted)
