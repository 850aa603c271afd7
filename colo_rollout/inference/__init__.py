"""Inference side: layouts, the MoE model with paged KV, the engine and its parts."""
