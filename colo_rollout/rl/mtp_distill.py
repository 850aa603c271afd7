"""A model's MTP layer fit to the model's own outputs: a draft head learnt from data.

Owns ``distill_mtp``: given full megatron-named weights with an MTP layer (``mtp.layers.0.*``)
and token sequences the model itself produced (greedy continuations from the engine), train
only the MTP layer with megatron's own MTP loss -- the layer at position i predicts token
i + 2 from the decoder's hidden state at i and the embedding of token i + 1, exactly what it
drafts when serving (model/mtp.py) -- every other weight frozen, and return the weights with
the trained MTP tensors. This is how a draft head is made for a model that ships none
(speculative decoding's self-distillation); ``colo-rollout bench-mtp`` uses it for drafts that
are learnt rather than random (acceptance near zero) or constructed (model/mtp_oracle.py).

The training model is megatron's GPTModel (model/megatron_gpt.py ``build_reference``) in the
model's dtype on this rank alone (singleton groups: every rank fits the same layer from the
same data and seed; rank 0's result is broadcast so all ranks serve identical weights). Plain
Adam on the MTP parameters; the decoder runs under the same graph but takes no gradient.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from colo_rollout.config.tensor_shapes import MTP_PREFIX


@dataclass
class DistillResult:
    weights: dict[str, torch.Tensor]  # the input weights with the MTP layer's tensors trained
    # per step: the MTP loss (megatron's, mean over the batch's predicted positions) and the
    # share of those positions where the layer's argmax is the token two ahead
    losses: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    # after training, on ``held_out`` sequences the steps never saw (None: none given): the
    # share of their positions where the layer's argmax is the token two ahead -- what tells a
    # head that generalises from one that memorised its data
    held_out_accuracy: float | None = None


def distill_mtp(model_cfg, weights: dict[str, torch.Tensor], sequences: list[list[int]],
                device: torch.device, *, steps: int = 300, batch: int = 8, lr: float = 1e-3,
                loss_from: int = 0, seed: int = 0, log_every: int = 0,
                held_out: list[list[int]] | None = None) -> DistillResult:
    """Fit the MTP layer of ``weights`` (``model_cfg.mtp_num_layers`` 1) to ``sequences``
    (each >= 3 tokens: the model's own outputs, prompt included) for ``steps`` Adam steps of
    ``batch`` sequences; ``loss_from``: the first position whose token is a target (the
    prompts' tokens, when they are not the model's own, teach nothing). In the model's
    parameter dtype (``model_cfg.params_dtype``). Collective when a process group is
    initialised (the result is broadcast from rank 0). ``log_every`` > 0: a progress line
    every that many steps. ``held_out``: sequences to measure the trained layer on."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from colo_rollout.model.megatron_gpt import build_reference, singleton_pg_collection
    from colo_rollout.rl.trainer import setup_mtp

    if model_cfg.mtp_num_layers != 1:
        raise ValueError("distill_mtp needs model.mtp_num_layers: 1")
    if not any(k.startswith(MTP_PREFIX) for k in weights):
        raise ValueError(f"distill_mtp: the weights have no MTP layer ({MTP_PREFIX}*)")
    seqs = [list(s) for s in sequences if len(s) >= 3]
    if not seqs:
        raise ValueError("distill_mtp needs sequences of at least 3 tokens")
    if steps < 1 or batch < 1:
        raise ValueError(f"distill_mtp: steps {steps} and batch {batch} must be >= 1")
    model = build_reference(model_cfg, weights, singleton_pg_collection(), device)
    model.train()
    core = getattr(model, "module", model)  # inside megatron's Float16Module in bf16
    params = []
    for name, p in core.named_parameters():
        trains = name.startswith(MTP_PREFIX)
        p.requires_grad_(trains)
        if trains:
            params.append(p)
    setup_mtp(core, 1.0)  # megatron's MTP loss, backward through its MTPLossAutoScaler
    opt = torch.optim.Adam(params, lr=lr)
    rng = random.Random(seed)
    held = [list(s) for s in held_out or [] if len(s) >= 3]
    L = max(len(s) for s in seqs + held)
    out = DistillResult(weights={})
    tracker = MTPLossLoggingHelper.tracker
    # every batch is padded to L: one causal mask and one position row for all of them
    mask = torch.triu(torch.ones(L, L, dtype=torch.bool, device=device), 1)[None, None]
    positions = torch.arange(L, device=device)[None]

    def forward(picked):  # megatron's forward with its MTP loss over ``picked``, padded to L
        n = len(picked)
        ids = torch.zeros(n, L, dtype=torch.long, device=device)
        real = torch.zeros(n, L, device=device)
        for i, s in enumerate(picked):
            ids[i, : len(s)] = torch.tensor(s, device=device)
            real[i, loss_from: len(s)] = 1.0  # the MTP loss's mask indexes targets
        MTPLossLoggingHelper.clean_metrics_in_tracker()
        return model(ids, positions.expand(n, L), attention_mask=mask, loss_mask=real)

    t0 = time.perf_counter()
    for step in range(steps):
        logits = forward([seqs[rng.randrange(len(seqs))] for _ in range(batch)])
        # the decoder's own loss is not trained (frozen); a zero-weighted sum reaches the
        # autoscaler, whose backward carries the MTP loss's gradient
        (logits.float().sum() * 0.0).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.losses.append(float(tracker["loss_values"][0]))
        total = float(tracker["total_values"][0])
        out.accuracy.append(float(tracker["correct_values"][0]) / max(total, 1.0))
        if log_every and (step + 1) % log_every == 0:
            print(f"distill_mtp: step {step + 1}/{steps}, MTP loss {out.losses[-1]:.3f}, draft "
                  f"accuracy {out.accuracy[-1]:.3f}, {time.perf_counter() - t0:.1f} s",
                  flush=True)
    if held:  # the training forward (its loss counts), without a backward
        correct = total = 0.0
        with torch.no_grad():
            for i in range(0, len(held), batch):
                forward(held[i: i + batch])
                correct += float(tracker["correct_values"][0])
                total += float(tracker["total_values"][0])
        out.held_out_accuracy = correct / max(total, 1.0)
    trained = {n: p.detach() for n, p in core.named_parameters() if n.startswith(MTP_PREFIX)}
    res = {}
    for k, v in weights.items():
        t = trained.get(k)
        if t is not None:
            t = t.to(v.dtype).to(v.device).contiguous()
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast(t, 0)
        res[k] = t if t is not None else v
    missing = set(trained) - set(weights)
    if missing:
        raise KeyError(f"distill_mtp: trained tensors without a weight of that name: "
                       f"{sorted(missing)[:4]}")
    out.weights = res
    del model, core, opt, params
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out
