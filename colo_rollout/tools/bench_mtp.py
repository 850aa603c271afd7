"""`colo-rollout bench-mtp CONFIG`: decode throughput with MTP drafting against without, same run.

Owns one measurement (issue 19 item 1): the config's model with an MTP layer
(``model.mtp_num_layers`` forced to 1) served by two engines side by side on the same ranks --
``engine.mtp`` off and on -- each with its D graphs captured first. For every batch size B of
``--batches``: B greedy requests of ``--prompt-len`` random tokens and ``--new-tokens`` new
tokens, served once with 1 new token (the prefill alone) and once in full; decode tokens/s =
B * (new - 1) / (full - prefill-only). Three weight sets, loaded in place into both engines:

  * ``random``: drafts almost never accepted -- what MTP costs when it does not help;
  * ``oracle`` (model/mtp_oracle.py): a per-token model whose MTP layer provably drafts right,
    every layer's GEMMs still full size -- the most MTP can give at this shape;
  * ``distilled``: the random weights with their MTP layer trained (``--distill-steps`` Adam
    steps of megatron's MTP loss, everything else frozen: rl/mtp_distill.py) on the model's
    own greedy continuations of ``--distill-seqs`` other random prompts -- drafts learnt from
    data, as a draft head made for a model that ships none; its loss and draft accuracy
    over the steps go in the JSON (``--distill-steps 0``: no such row).

The acceptance rate and tokens per D iteration come from the MTP engine's scheduler; the
greedy tokens of both engines are compared (they must be equal). Any acceptance rate between
the two rows interpolates. Table on stdout, ``bench_mtp.json`` in ``--out``.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import random
import time

import torch

from colo_rollout.config import load_config
from colo_rollout.runtime.parallel import init_parallel
from colo_rollout.config.files import strict_json, write_output


def _requests(B: int, prompt_len: int, new: int, vocab: int, seed: int, tag: str):
    from colo_rollout.sched.request import Request, SamplingParams

    rng = random.Random(seed)
    return [Request(f"{tag}{i}", tuple(rng.randrange(vocab) for _ in range(prompt_len)),
                    SamplingParams(max_tokens=new, ignore_eos=True)) for i in range(B)]


def _timed(engine, reqs) -> tuple[float, dict]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, outs


def _distilled(base, groups, weights: dict, prompt_len: int, new_tokens: int, seqs: int,
               steps: int, batch: int) -> tuple[dict, dict]:
    """The random weights with their MTP layer fit to the model's own greedy continuations
    (an engine without MTP makes them, from prompts no timed run uses) -> (weights, the
    training's record)."""
    from colo_rollout.engine.engine import Engine
    from colo_rollout.rl.mtp_distill import distill_mtp

    cfg = dataclasses.replace(base, engine=dataclasses.replace(base.engine, mtp=False))
    eng = Engine(cfg, groups, weights)
    reqs = _requests(seqs, prompt_len, new_tokens, base.model.vocab_size, 1000, "distill-")
    t0 = time.perf_counter()
    outs = eng.generate(reqs)
    gen_s = time.perf_counter() - t0
    eng.close()
    del eng  # its model and KV, before the training model is built beside the weights
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    data = [list(r.prompt) + list(outs[r.request_id].tokens) for r in reqs]
    # an eighth held out: the fitted layer's accuracy on continuations it never saw
    cut = len(data) - max(1, len(data) // 8) if len(data) > 1 else len(data)
    data, held = data[:cut], data[cut:]
    if groups.rank == 0:
        print(f"bench-mtp: {seqs} greedy continuations for the distilled head in {gen_s:.1f} s; "
              f"fitting its MTP layer ({steps} steps of {batch})", flush=True)
    t0 = time.perf_counter()
    res = distill_mtp(base.model, weights, data, groups.device, steps=steps, batch=batch,
                      loss_from=prompt_len,
                      log_every=max(1, steps // 5) if groups.rank == 0 else 0, held_out=held)
    k = max(1, steps // 10)  # the first and last tenth of the steps, averaged
    return res.weights, {
        "sequences": seqs, "steps": steps, "batch": batch, "generate_s": gen_s,
        "train_s": time.perf_counter() - t0,
        "loss_first": sum(res.losses[:k]) / k, "loss_last": sum(res.losses[-k:]) / k,
        "accuracy_first": sum(res.accuracy[:k]) / k,
        "accuracy_last": sum(res.accuracy[-k:]) / k,
        "held_out_accuracy": res.held_out_accuracy, "losses": res.losses,
        "accuracy": res.accuracy}


def run_bench_mtp(rank: int, world: int, config_path: str, overrides: dict | None = None,
                  batches: tuple[int, ...] = (1, 8, 32, 64), prompt_len: int = 128,
                  new_tokens: int = 128, reps: int = 2, distill_steps: int = 300,
                  distill_seqs: int = 128, distill_batch: int = 8) -> dict:
    from colo_rollout.engine.engine import Engine
    from colo_rollout.model.weights import random_state_dict
    from colo_rollout.model.mtp_oracle import oracle_state_dict

    base = load_config(config_path, {**(overrides or {}), "model.mtp_num_layers": 1})
    groups = init_parallel(base.parallel)
    dev = groups.device
    weights = {"random": random_state_dict(base.model, device=dev)}
    distill = None
    if distill_steps:  # first: its engine and training model are gone before the oracle's set
        distilled, distill = _distilled(base, groups, weights["random"], prompt_len, new_tokens,
                                        distill_seqs, distill_steps, distill_batch)
    weights["oracle"] = oracle_state_dict(base.model, device=dev)
    if distill_steps:
        weights["distilled"] = distilled
    ctx = prompt_len + new_tokens + 1
    got: dict[tuple, dict] = {}  # (weights, batch, mtp) -> measurements
    for mtp in (False, True):  # one engine at a time: each holds a model and its KV
        cfg = dataclasses.replace(base, engine=dataclasses.replace(base.engine, mtp=mtp))
        eng = Engine(cfg, groups, weights["random"])
        sched = eng.scheduler
        for wname, sd in weights.items():
            eng.model.load_full_state_dict(sd)  # in place: captured graphs stay valid
            eng.warmup(max_context=ctx)
            for B in batches:
                # this B's whole run once untimed (first-use costs -- allocator growth, its P
                # bucket's kernels, its D kernels at the longer contexts -- stay out of the
                # timed runs): a first use would land in the prefill-only run (cancelling the
                # decode time out) or in the timed decode
                eng.generate(_requests(B, prompt_len, new_tokens, base.model.vocab_size, 98,
                                       f"{wname}-{B}-warm-"))
                best_pre = best_full = float("inf")
                for rep in range(reps):
                    tag = f"{wname}-{B}-{rep}-"
                    pre, _ = _timed(eng, _requests(B, prompt_len, 1, base.model.vocab_size,
                                                   rep, tag + "p"))
                    v0, a0 = sched.drafts_verified, sched.drafts_accepted
                    d0 = sum(1 for h in eng.history if h.d_rows > 0)
                    full, outs = _timed(eng, _requests(B, prompt_len, new_tokens,
                                                       base.model.vocab_size, rep, tag + "f"))
                    best_pre, best_full = min(best_pre, pre), min(best_full, full)
                    d_iters = sum(1 for h in eng.history if h.d_rows > 0) - d0
                    verified, accepted = sched.drafts_verified - v0, sched.drafts_accepted - a0
                got[wname, B, mtp] = {
                    # NaN when the decode time does not come out positive (a timing
                    # outlier): no number rather than an absurd one
                    "tok_s": (B * (new_tokens - 1) / (best_full - best_pre)
                              if best_full > best_pre else float("nan")),
                    "d_iterations": d_iters, "acceptance": accepted / max(verified, 1),
                    "tokens": [outs[r].tokens for r in sorted(outs)]}
        eng.close()
    rows, same = [], True
    for wname in weights:
        for B in batches:
            off, on = got[wname, B, False], got[wname, B, True]
            pairs = list(zip(off["tokens"], on["tokens"]))
            prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                      / max(len(a), 1) for a, b in pairs]
            row = {"weights": wname, "batch": B, "base_tok_s": off["tok_s"],
                   "mtp_tok_s": on["tok_s"], "speedup": on["tok_s"] / off["tok_s"],
                   "acceptance": on["acceptance"],
                   "base_d_iterations": off["d_iterations"],
                   "mtp_d_iterations": on["d_iterations"],
                   # tokens one sequence gets per D iteration (all B rows run throughout)
                   "tokens_per_d_iteration": (new_tokens - 1) / max(on["d_iterations"], 1),
                   "same_tokens": off["tokens"] == on["tokens"],
                   # greedy streams equal to the run without MTP, and their common prefix
                   # (bf16: the verify forward's 2B-row GEMMs may round otherwise than B-row
                   # ones, and a stream parts at the first near-tie)
                   "identical_streams": sum(a == b for a, b in pairs) / len(pairs),
                   "common_prefix": sum(prefix) / len(prefix)}
            same &= row["same_tokens"]
            rows.append(row)
    return {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU",
            "layout": groups.layout.name, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "rows": rows, "same_tokens": same, "distill": distill}


def report(res: dict, out_dir: str) -> None:
    print(f"bench-mtp on {res['device']}: layout {res['layout']}, {res['prompt_len']}-token "
          f"prompts, {res['new_tokens']} new tokens, greedy")
    print(f"{'weights':>8} {'B':>4} {'base tok/s':>11} {'MTP tok/s':>10} {'speedup':>8} "
          f"{'accept':>7} {'tok/D-iter':>10} {'same streams':>12} {'prefix':>7}")
    for r in res["rows"]:
        print(f"{r['weights']:>8} {r['batch']:>4} {r['base_tok_s']:>11.1f} {r['mtp_tok_s']:>10.1f} "
              f"{r['speedup']:>7.2f}x {r['acceptance']:>7.3f} {r['tokens_per_d_iteration']:>10.2f} "
              f"{r['identical_streams']:>12.3f} {r['common_prefix']:>7.3f}")
    d = res.get("distill")
    if d:
        print(f"distilled: the MTP layer fit in {d['steps']} steps of {d['batch']} on "
              f"{d['sequences']} greedy continuations ({d['train_s']:.1f} s): MTP loss "
              f"{d['loss_first']:.3f} -> "
              f"{d['loss_last']:.3f}, draft accuracy {d['accuracy_first']:.3f} -> "
              f"{d['accuracy_last']:.3f} (first / last tenth of the steps), on held-out "
              f"continuations {d['held_out_accuracy'] if d['held_out_accuracy'] is not None else float('nan'):.3f}")
    path = os.path.join(out_dir, "bench_mtp.json")
    write_output(path, strict_json(res, indent=1), "the report")
    print(f"JSON: {path}")
