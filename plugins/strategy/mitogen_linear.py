"""site.yml's strategy: Ansible's `linear` over Mitogen's connections (ansible.cfg names it).

Mitogen keeps one Python interpreter per node for the whole run and runs each module in it, so a task that changes
nothing no longer pays a fresh interpreter and the import of ansible.module_utils on the node (~0.2 CPU-s a module
here). The plays, their order and every result are linear's. `ANSIBLE_STRATEGY=linear` runs without it.

What this module adds is for the controller, which forks a worker per task and host and, on a re-run, is where the
time goes: each play's workers are forked from a process that has already loaded every Jinja filter and test plugin
(otherwise each worker imports all of them again at its first `| bool`) and whose objects the garbage collector no
longer walks (a collection in a worker would otherwise touch, and so copy, every page the fork shares).
"""

import gc

from ansible.plugins.loader import filter_loader, test_loader
from ansible_mitogen.plugins.strategy.mitogen_linear import StrategyModule as _MitogenLinear

__all__ = ["StrategyModule", "prepare_to_fork"]


def prepare_to_fork() -> None:
    """Load the Jinja plugins and freeze the heap in the process that forks the workers, before each play (the
    loaders keep what they loaded: a later play pays only the collection)."""
    for loader in (filter_loader, test_loader):
        for _plugin in loader.all():
            pass
    gc.collect()
    gc.freeze()


class StrategyModule(_MitogenLinear):
    def run(self, iterator, play_context):
        prepare_to_fork()
        return super().run(iterator, play_context)
