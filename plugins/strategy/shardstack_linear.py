"""The `linear` strategy, run through Mitogen for Ansible when it is installed (the `ops` extra installs it).

Mitogen keeps one Python interpreter per node for the whole run and caches imported module code there, instead of
shipping and compiling an AnsiballZ payload (~0.25 s of node CPU with ansible-core 2.19) for every task; an
idempotent site.yml re-run on the lab drops from ~75 s to ~44 s. Where Mitogen is missing (e.g. a system
ansible-core outside the project's venv) this is Ansible's own `linear`, with a warning.
"""

from __future__ import annotations

DOCUMENTATION = """
name: shardstack_linear
short_description: linear, through Mitogen for Ansible when it is installed
description:
  - Ansible's linear strategy; tasks run through Mitogen's persistent interpreters when the mitogen package is
    importable, else through Ansible's own connection plugins.
author: shardstack
"""

try:
    from ansible_mitogen.plugins.strategy.mitogen_linear import StrategyModule
except ImportError as exc:
    from ansible.plugins.strategy.linear import StrategyModule
    from ansible.utils.display import Display

    Display().warning(f"shardstack_linear: Mitogen is not importable ({exc}); running the plain linear strategy")

__all__ = ["StrategyModule"]
