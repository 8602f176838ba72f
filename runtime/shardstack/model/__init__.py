"""Models and their artifacts: the architectures (`gpt`), the KV cache, the factory a job config builds from,
the dtype table, and the exported-model format that training writes and serving reads (`artifact`)."""
