"""Issue 16's fusions at the model level, run by Triton's CPU interpreter in a subprocess
(tests/interpreted.py; skipped when triton does not import): a one-rank bf16 Qwen3-shaped
model (per-head q/k RMSNorm, 4 query heads on one KV head, top-8 of 8 experts, the grouped
expert path) with its kernels forced to Triton -- attention, the rope-and-store kernel, the
residual adds -- runs a prefill of two sequences and a decode step on them four ways:

  * unfused: the q/k norms as modules, the k slots summed in fp32 and added by add_rounded;
  * slots: the slot sum fused into the residual add (model/residual.py: add_rounded_slots);
  * both: the q/k norms fused into the rope kernel as well (model/rope_kv.py);
  * norms: and in prefill and decode each residual add fused with the RMSNorm after it
    (model/norm_add.py: the attention's add with the pre-MLP norm, the slots' add with the
    next layer's input norm or the final norm; P through ``MoEBlock.normed``), and P's
    embedding with layer 0's input norm (``embed_rms_norm``).

"slots" must give the unfused run's logits and KV caches bitwise (the fusion's promise).
"both" may differ only by the rope kernel's sum of squares: its K cache (normalised, rotated
keys) by at most one bf16 ulp per element, its logits by LOGIT_TOL -- room for such a flip to
travel through two layers into bf16 logits of magnitude ~2, whose ulp is 1/64. Measured on
these inputs: no element and no logit differs at all. (For scale: the q and k norm weights
swapped moves the logits by 0.11 and 331 of the 336 K cache elements, by up to 256 ulps.)
"norms" may differ from "both" by the add+norm kernel's sum of squares alone (its residual
stream is bitwise), which reaches layer 1's q, k and v in prefill and decode: the same
bounds, V_ULPS for its v. Measured: no element and no logit differs. That the fused paths really ran -- and the
norm modules they replace did not -- is counted, not assumed. The torch path at one rank -- the
slot sum fused there too, by slot_sum -- is what tests/test_engine.py's
test_grouped_expert_path_matches_megatron_reference[1-1-1] compares with megatron's
GPTModel."""

from __future__ import annotations

import pytest

from tests.interpreted import HAS_TRITON, interpreted_main

LOGIT_TOL = 2 / 64  # "both", "norms" vs "unfused": two ulps of the largest logits (measured: 0)
# V cache vs unfused, bf16 ulps: "both" leaves v alone (the q/k norms do not touch it);
# "norms" computes layer 1's v from the fused input norm, so a one-ulp flip there may move a
# projected v by an ulp (measured: 0)
V_ULPS = {"both": 0, "norms": 1}


def _model():
    import tempfile

    import torch
    import torch.distributed as dist

    from colo_rollout.config import ModelConfig, ParallelConfig
    from colo_rollout.model.model import InferenceGPT
    from colo_rollout.model.weights import random_state_dict
    from colo_rollout.runtime.parallel import init_parallel

    # a file rendezvous in a fresh directory: no port to collide with a parallel run
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rdzv", rank=0,
                            world_size=1)
    groups = init_parallel(ParallelConfig(world_size=1, backend="gloo"))
    cfg = ModelConfig(vocab_size=64, hidden_size=64, num_layers=2, num_attention_heads=4,
                      num_query_groups=1, head_dim=24, qk_layernorm=True, norm_epsilon=1e-6,
                      moe_ffn_hidden_size=32, num_experts=8, moe_router_topk=8,
                      max_position_embeddings=64, init_method_std=0.1, seed=3,
                      params_dtype="bfloat16", moe_compute="grouped")
    model = InferenceGPT(cfg, groups, torch.bfloat16, "torch", "torch", "torch")
    model.load_full_state_dict(random_state_dict(cfg))
    # the Triton kernels, under the interpreter (model build refuses "triton" off CUDA)
    model.residual_kernel = "triton"
    for layer in model.decoder.layers:
        layer.self_attention.decode_backend = "triton"
        layer.self_attention.prefill_backend = "triton"
    return model


def _inputs(device):
    import torch

    from colo_rollout.model.attention import AttnMetadata
    from colo_rollout.model.model import DecodeInputs, PrefillInputs

    i64 = torch.int64
    lens = [3, 2]  # two sequences, block size 4: blocks (0, 1) and (2, 4); the sink is 5
    tables = torch.tensor([[0, 1], [2, 4]], dtype=i64)
    p = PrefillInputs(
        token_ids=torch.tensor([7, 3, 60, 22, 41], dtype=i64), row_counts=[5], last_counts=[2],
        last_rows=torch.tensor([2, 4], dtype=i64),
        attn=AttnMetadata(is_prefill=True, positions=torch.tensor([0, 1, 2, 0, 1], dtype=i64),
                          slot_mapping=torch.tensor([0, 1, 2, 8, 9], dtype=i64),
                          block_tables=tables, context_lens=torch.tensor(lens, dtype=i64),
                          seq_lens_new=lens, context_lens_host=lens))
    steps = []
    for j, toks in enumerate(([12, 33],)):  # positions (3, 2): reads the prefill's K/V
        ps = [lens[0] + j, lens[1] + j]
        steps.append(DecodeInputs(
            token_ids=torch.tensor(toks, dtype=i64),
            attn=AttnMetadata(is_prefill=False, positions=torch.tensor(ps, dtype=i64),
                              slot_mapping=torch.tensor([ps[0], 8 + ps[1]], dtype=i64),
                              block_tables=tables,
                              context_lens=torch.tensor([q + 1 for q in ps], dtype=i64),
                              seq_lens_new=[], context_lens_host=[])))
    return p, steps


def _run(model, fuse_slots: bool, fuse_norm: bool, fuse_add_norm: bool):
    """(prefill logits, decode logits per step, K cache, V cache), and the fused calls
    counted: [slot adds (fused with a norm or not), rope launches given a q/k norm, attention
    adds fused with the pre-MLP norm, slot adds fused with the next norm, add+norm kernel
    launches, calls of the layers' and the final RMSNorm modules, embedding + norm calls]."""
    from colo_rollout.model import attention, model as model_mod, norm_add

    counts = [0, 0, 0, 0, 0, 0, 0]
    add_slots, rope = model_mod.add_rounded_slots, attention.rope_and_store
    add_norm, slots_norm = model_mod.add_rms_norm, model_mod.add_slots_rms_norm
    embed_norm = model_mod.embed_rms_norm
    launch = norm_add._launch

    def counted(fn, *slots):
        def call(*a, **kw):
            for j in slots:
                counts[j] += 1
            return fn(*a, **kw)
        return call

    def counted_rope(*a, **kw):
        counts[1] += kw.get("qk_norm") is not None
        return rope(*a, **kw)

    def counted_norm(*_):
        counts[5] += 1

    norms = [m for layer in model.decoder.layers
             for m in (layer.input_layernorm, layer.pre_mlp_layernorm)]
    hooks = [m.register_forward_hook(counted_norm)
             for m in norms + [model.decoder.final_layernorm]]
    # the unfused paths: the fusions' own predicates say no (instance attributes, removed
    # after the run; the module functions are restored likewise)
    if not fuse_slots:
        model._slots_into_residual = lambda mlp, x: False
    if not fuse_norm:
        for layer in model.decoder.layers:
            layer.self_attention._fused_qk_norm = lambda: None
    if not fuse_add_norm:
        model._fusable_norm = lambda norm: None
    model_mod.add_rounded_slots, attention.rope_and_store = counted(add_slots, 0), counted_rope
    model_mod.add_rms_norm = counted(add_norm, 2)
    model_mod.add_slots_rms_norm = counted(slots_norm, 0, 3)
    model_mod.embed_rms_norm = counted(embed_norm, 6)
    norm_add._launch = counted(launch, 4)
    try:
        kv = model.new_kv_storage(num_blocks=5, block_size=4)
        p, steps = _inputs(model.device)
        logits = [model.forward_prefill(p, kv)]
        logits += [model.forward_decode(s, kv) for s in steps]
    finally:
        model_mod.add_rounded_slots, attention.rope_and_store = add_slots, rope
        model_mod.add_rms_norm, model_mod.add_slots_rms_norm = add_norm, slots_norm
        model_mod.embed_rms_norm = embed_norm
        norm_add._launch = launch
        for h in hooks:
            h.remove()
        model.__dict__.pop("_slots_into_residual", None)
        model.__dict__.pop("_fusable_norm", None)
        for layer in model.decoder.layers:
            layer.self_attention.__dict__.pop("_fused_qk_norm", None)
    return logits, kv.k.clone(), kv.v.clone(), counts


def _interpreted() -> list[str]:
    import torch

    fails = []
    model = _model()
    unfused = _run(model, False, False, False)
    slots = _run(model, True, False, False)
    both = _run(model, True, True, False)
    norms = _run(model, True, True, True)
    forwards, layers = 2, 2  # one prefill, one decode step; two MoE layers
    modules = forwards * (2 * layers + 1)  # per forward: two norms a layer and the final one
    want = {"unfused": [0, 0, 0, 0, 0, modules, 0],
            "slots": [forwards * layers, 0, 0, 0, 0, modules, 0],
            "both": [forwards * layers, forwards * layers, 0, 0, 0, modules, 0],
            # both adds of each layer fused with their norms (the kernel, not the torch
            # path), and P's layer 0 input norm with the embedding: D's layer 0 input norm
            # is the one module called
            "norms": [forwards * layers, forwards * layers, forwards * layers,
                      forwards * layers, 2 * forwards * layers, 1, 1]}
    got = {"unfused": unfused[3], "slots": slots[3], "both": both[3], "norms": norms[3]}
    if got != want:
        fails.append(f"fused calls (slot adds, normed ropes, add+norm, slots+norm, their "
                     f"kernel launches, norm modules, embedding+norm): {got}, expected {want}")
    for name, a, b in zip(("prefill", "decode"), slots[0], unfused[0]):
        if not torch.equal(a, b):
            fails.append(f"slots vs unfused: {name} logits differ, max "
                         f"{(a.float() - b.float()).abs().max().item():.3g}")
    for name, a, b in zip(("K cache", "V cache"), slots[1:3], unfused[1:3]):
        if not torch.equal(a, b):
            fails.append(f"slots vs unfused: {name} differs")
    for name, run in (("both", both), ("norms", norms)):
        worst = max((a.float() - b.float()).abs().max().item()
                    for a, b in zip(run[0], unfused[0]))
        if not worst <= LOGIT_TOL:
            fails.append(f"{name} vs unfused: logits differ by {worst:.3g} > {LOGIT_TOL}")
        k_ulps, v_ulps = _bf16_ulps(run[1], unfused[1]), _bf16_ulps(run[2], unfused[2])
        if not (k_ulps <= 1 and v_ulps <= V_ULPS[name]):
            fails.append(f"{name} vs unfused: K cache {k_ulps} bf16 ulps apart (at most 1), V "
                         f"cache {v_ulps} (at most {V_ULPS[name]})")
        print(f"{name} vs unfused: max logit difference {worst:.3g}, K cache {k_ulps} ulps, "
              f"V cache {v_ulps} ulps")
    _sorted_slots_check(model, fails)
    return fails


def _sorted_slots_check(model, fails) -> None:
    """The experts on the Triton kernel in a prefill long enough for its prefill regime (45
    tokens: R / E = 45 rows per expert > DECODE_ROWS): fc2 leaves its rows sorted and the
    fused slot sums read them by index (``fused_moe.stores_sorted``, ``SortedSlots``) -- the
    logits and caches bitwise those of the scattered store; and the sorted slots did reach
    the sums (counted)."""
    import torch

    from colo_rollout.model import moe as moe_mod
    from colo_rollout.model.attention import AttnMetadata
    from colo_rollout.model.model import PrefillInputs
    from colo_rollout.model.residual import SortedSlots

    i64, n = torch.int64, 45
    table = torch.arange(12, dtype=i64)[None]  # blocks of 4: 12 blocks hold 45 positions
    p = PrefillInputs(
        token_ids=torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(5)),
        row_counts=[n], last_counts=[1], last_rows=torch.tensor([n - 1], dtype=i64),
        attn=AttnMetadata(is_prefill=True, positions=torch.arange(n, dtype=i64),
                          slot_mapping=torch.arange(n, dtype=i64), block_tables=table,
                          context_lens=torch.tensor([n], dtype=i64), seq_lens_new=[n],
                          context_lens_host=[n]))
    for layer in model.decoder.layers:
        layer.mlp.kernel, layer.mlp._kernel = "triton", {}
    seen, grouped, stores_sorted_fn = [0], moe_mod.GatherMoE._grouped, moe_mod.stores_sorted

    def counting(self, *a, **kw):
        out = grouped(self, *a, **kw)
        seen[0] += isinstance(out, SortedSlots)
        return out

    runs = []
    moe_mod.GatherMoE._grouped = counting
    try:
        for keep in (True, False):
            if not keep:
                moe_mod.stores_sorted = lambda *a: False
            kv = model.new_kv_storage(num_blocks=13, block_size=4)
            runs.append((model.forward_prefill(p, kv), kv.k.clone(), kv.v.clone()))
    finally:
        moe_mod.GatherMoE._grouped = grouped
        moe_mod.stores_sorted = stores_sorted_fn
        for layer in model.decoder.layers:
            layer.mlp.kernel, layer.mlp._kernel = "torch", {}
    if seen[0] != len(model.decoder.layers):
        fails.append(f"sorted slots reached {seen[0]} MoE layers, not every one")
    for name, a, b in zip(("logits", "K cache", "V cache"), runs[0], runs[1]):
        if not torch.equal(a, b):
            fails.append(f"sorted vs scattered fc2 rows: the {name} differ")


def _bf16_ulps(a, b) -> float:
    """The largest |a - b| over bf16 tensors in units of the larger value's bf16 ulp."""
    import torch

    a, b = a.float(), b.float()
    exp = torch.frexp(torch.maximum(a.abs(), b.abs())).exponent  # x = m 2^e, m in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(a), exp - 8).clamp_min(2.0 ** -133)  # 8 bits: 1 + 7
    return ((a - b).abs() / ulp).max().item()


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fused_norm_and_slot_sum_keep_the_model_interpreted(interpreted):
    interpreted.check(__file__)


if __name__ == "__main__":  # the interpreted run (the test above starts it)
    interpreted_main(_interpreted)
