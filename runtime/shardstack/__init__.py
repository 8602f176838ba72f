"""shardstack: GPU cluster provisioning (Ansible) plus a sharded training and inference runtime."""

__version__ = "0.1.0"
