"""Test-only helpers kept out of the hot modules: host-emulated streams, the per-sequence prefill attention oracle."""
