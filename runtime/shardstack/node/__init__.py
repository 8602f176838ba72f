"""Programs the roles and playbooks run on the nodes (`python -m shardstack.node.<name>` from the node's venv):
the shared storage's artifact pruning, the all-reduce probe. They import no controller code (ops, cli)."""
