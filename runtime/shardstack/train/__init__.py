"""The sharded training runtime: job config, process groups, data, optimizer, parallel wrapping (ZeRO stages 0-3),
the engine's step, the training loop with its metrics, checkpoints (`checkpoint/`) and memory (`memory/`)."""
