"""Build tools that run on the controller before a deploy: the per-accelerator wheelhouse and the demo's pretrained
model. They import no cluster operations (ops) and no CLI."""
