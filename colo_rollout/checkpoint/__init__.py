"""Hugging Face checkpoints: reading and writing safetensors, config.json families, name mapping, per-rank loading and export."""
