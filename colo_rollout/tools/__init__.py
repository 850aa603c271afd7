"""Commands built on the engine: bench, bench-decode, demo, generate, and the model-free turnstile stress."""
