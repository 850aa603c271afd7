"""MTP speculative decoding's per-iteration step: verify the last draft, draft the next token.

Owns the verify rows' layout and the acceptance rule; the D iteration (worker/runner.py, eager)
and its CUDA graph (worker/decode_graph.py, all-greedy rows) both call ``verify_and_draft`` so
the two paths run the same ops.

Layout (engine.mtp): a sequence with input token t at position n and draft d contributes two
consecutive D rows, (t, n) and (d, n + 1) -- rows 2j and 2j + 1 of the replica's bucket; both
write their KV, and row 2j + 1 attends to row 2j's (context n + 2), so one D forward of 2B
rows verifies B drafts with the ordinary decode attention.

Acceptance (k = 1, a deterministic draft): sample the target at both rows with the row's own
parameters, y0 at n and y1 at n + 1; the draft is accepted iff y0 == d, and then y1 is the bonus
token. For greedy rows that is "argmax equals the draft"; for sampled rows it is exactly
speculative rejection sampling with a point-mass draft (accept with probability p(d), else a
sample of p without d), so the emitted tokens have the target's distribution. Every emitted
token's logprob is the target's at its row.

Packed output [6, B] float64 (exact for token ids and fp32 logprobs): y0, logprob(y0), y1,
logprob(y1), accepted (0/1), the next draft -- the MTP layer's argmax at row 2j + accepted,
the sequence's last emitted token.
"""

from __future__ import annotations

import torch

from colo_rollout.model.mtp import mtp_decode

ROWS_PER_SEQUENCE = 2  # verify rows per sequence (one draft token)


def verify_and_draft(model, kv, inputs, logits: torch.Tensor, hidden: torch.Tensor,
                     tokens: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """One MTP D iteration's result from its verify forward. ``inputs``: the DecodeInputs of
    the 2B verify rows (token_ids[2j + 1] is sequence j's draft); ``logits`` [2B, V] and
    ``hidden`` [2B, H]: the forward's outputs; ``tokens``/``logprobs`` [2B]: the sampled target
    tokens of every row (padding rows: anything). Runs the MTP layer (collective over the
    world) and returns the packed [6, B] result. No host sync: graph-capturable."""
    B = tokens.shape[0] // 2
    accepted = tokens[0::2] == inputs.token_ids[1::2]
    select = 2 * torch.arange(B, device=tokens.device) + accepted.long()
    drafts = mtp_decode(model, hidden, tokens, inputs, kv, select).argmax(dim=-1)
    return torch.stack([tokens[0::2].double(), logprobs[0::2].double(),
                        tokens[1::2].double(), logprobs[1::2].double(),
                        accepted.double(), drafts.double()])
