"""Device state and execution: the worker (model, KV storage, graphs, memory release/resume), the runner that executes a step plan, decode and prefill CUDA graphs, and sampling."""
