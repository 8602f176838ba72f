"""Models and their artifacts: the model contract and registry a job config builds from (`spec`, torch-free, with
the shapes in `shapes`), the shared decoder trunk and the architectures (`decoder`, `gpt`, `llama`), the KV cache,
the dtype table, and the exported-model format that training writes and serving reads (`artifact`)."""
