"""Step scheduling: which sequences run in the next step (chunked prefill, continuous batching,
preemption), and what a step is on its way through the model runner (`step`)."""
