"""Ansible's linear strategy, run over Mitogen (ansible.cfg makes it the default).

Mitogen keeps one Python interpreter per host for the whole play and reuses the modules it
has already imported, where plain Ansible starts a new interpreter and imports its module
utilities for every task. On the testbed's TCG VMs that start-up is most of a task's cost
(a first `make deploy` of the storage fabric: 12.5 min plain, 3.5 min over Mitogen). A lab
that wants plain Ansible runs `ANSIBLE_STRATEGY=linear make deploy ...`.
"""

from ansible_mitogen.loaders import strategy_loader
from ansible_mitogen.strategy import StrategyMixin

_Linear = strategy_loader.get("linear", class_only=True)


class StrategyModule(StrategyMixin, _Linear):
    """The linear strategy with Mitogen's connection and module execution."""
