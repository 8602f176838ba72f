"""Training checkpoints: the on-disk layout and manifest (`layout`), and the collective save/resume
(`checkpointer`)."""
