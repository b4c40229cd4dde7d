"""The model: its config, the Llama-family module over paged KV, its tensor-parallel layers, and
loading weights (GGUF, safetensors, or random for benchmarks)."""
