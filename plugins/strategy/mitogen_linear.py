"""site.yml's strategy: Ansible's `linear` over Mitogen's connections (ansible.cfg names it).

Mitogen keeps one Python interpreter per node for the whole run and runs each module in it, so a task that changes
nothing no longer pays a fresh interpreter and the import of ansible.module_utils on the node (~0.2 CPU-s a module
here). The plays, their order and every result are linear's. This file only makes the strategy findable beside the
project's ansible.cfg (and in the collection's plugins/strategy); `ANSIBLE_STRATEGY=linear` runs without it.
"""

from ansible_mitogen.plugins.strategy.mitogen_linear import StrategyModule

__all__ = ["StrategyModule"]
