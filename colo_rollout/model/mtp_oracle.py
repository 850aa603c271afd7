"""Weights under which a model's MTP layer provably drafts right: the accept path of MTP
speculative decoding, end to end, without training a draft head.

``oracle_state_dict(cfg)``: a random megatron-named state dict (model/weights.py) changed so
that the model computes a per-token function -- every layer's attention adds nothing
(``linear_proj`` zero) and every layer after the first adds nothing either (its MLP/expert
``fc2`` zero), so the logits at position i depend on token i alone: t_{i+1} = f(t_i) -- and the
MTP layer computes the same f of the next token: embedding rows of RMS 1 and a unit ``enorm``
make ``eh_proj = [I 0]`` hand it emb(t_{i+1}) as its residual stream, its transformer layer is
a copy of layer 0, its final norm the decoder's. Its output at i is then f(t_{i+1}) = t_{i+2},
the greedy target two ahead (up to the RMSNorm's eps: 1e-6 relative). Every layer's GEMMs
still run at full size, so the compute per step is the architecture's. Needs layer 0 of the
MTP layer's kind (the last decoder layer's).
"""

from __future__ import annotations

import torch

from colo_rollout.model.weights import random_state_dict
from colo_rollout.config.tensor_shapes import MTP_PREFIX, mtp_layer_prefix


def oracle_state_dict(cfg, device: torch.device | str | None = None) -> dict:
    """The oracle weights of ``cfg`` (a ModelConfig with ``mtp_num_layers`` 1)."""
    if cfg.mtp_num_layers != 1:
        raise ValueError("the MTP oracle needs model.mtp_num_layers: 1")
    if cfg.is_moe_layer(0) != cfg.is_moe_layer(cfg.num_layers - 1):
        raise ValueError("the MTP oracle copies layer 0 into the MTP layer, which is of the last "
                         "layer's kind: layer 0 must be too (model.first_k_dense, "
                         "model.dense_layers)")
    sd = random_state_dict(cfg, device=device)
    H = cfg.hidden_size
    emb = sd["embedding.word_embeddings.weight"].float()
    sd["embedding.word_embeddings.weight"] = (
        emb / emb.pow(2).mean(-1, keepdim=True).sqrt()).to(sd["embedding.word_embeddings.weight"].dtype)
    with torch.no_grad():
        for k, v in sd.items():
            if not k.startswith("decoder.layers."):
                continue
            layer = int(k.split(".")[2])
            if k.endswith("self_attention.linear_proj.weight") or (
                    layer > 0 and k.endswith("linear_fc2.weight")):
                v.zero_()
    first = "decoder.layers.0."
    for k in [k for k in sd if k.startswith(first)]:
        sd[mtp_layer_prefix(0) + k[len(first):]] = sd[k].clone()
    m = f"{MTP_PREFIX}0."
    dtype, dev = sd["decoder.final_layernorm.weight"].dtype, sd["decoder.final_layernorm.weight"].device
    sd[m + "enorm.weight"] = torch.ones(H, dtype=dtype, device=dev)
    sd[m + "hnorm.weight"] = torch.ones(H, dtype=dtype, device=dev)
    sd[m + "eh_proj.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1).to(
        sd[m + "eh_proj.weight"].dtype).to(dev)
    sd[m + "final_layernorm.weight"] = sd["decoder.final_layernorm.weight"].clone()
    return sd
