"""Fail a run at the first play that matches no host.

Ansible only warns when a play's host pattern matches nothing, so a deploy whose groups are
misspelt (the lab once had `storage_targets` where storage.yml targets `nvmeof_targets`) reports
success with nothing configured. Enabled in ansible.cfg, so it covers every playbook without
an edit to any play. Under `--limit` a play outside the limit is expected to match nothing:
that is said on a line, not failed; so it is where KVLAB_EMPTY_PLAYS=say (scripts/plan: a plan
renders what an inventory has, and says which groups it lacks; it configures nothing).
"""

from __future__ import annotations

DOCUMENTATION = """
name: kvlab_hosts_required
type: aggregate
short_description: fail the run when a play matches no host
description:
  - Stops ansible-playbook with exit status 2 at the first play whose hosts match no inventory
    host, naming the play, its host pattern and the inventory; under --limit it only says so.
requirements:
  - enabled in ansible.cfg (callbacks_enabled)
"""

import os
import sys

from ansible import context
from ansible.plugins.callback import CallbackBase
from ansible.utils.display import Display

display = Display()

# ansible-playbook's exit status for failed hosts: a play without hosts failed all of its none.
EXIT_NO_HOSTS = 2


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "kvlab_hosts_required"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._play = None

    def v2_playbook_on_play_start(self, play):
        self._play = play

    def v2_playbook_on_no_hosts_matched(self):
        play = self._play
        name = play.get_name() if play is not None else "?"
        pattern = ",".join(play.hosts) if play is not None and isinstance(play.hosts, list) else getattr(play, "hosts", "?")
        inventory = ",".join(context.CLIARGS.get("inventory") or ()) or "the default inventory"
        limit = context.CLIARGS.get("subset")
        if limit:
            display.display(f"kvlab: play {name!r} ({pattern}) has no host within --limit {limit}")
            return
        if os.environ.get("KVLAB_EMPTY_PLAYS") == "say":
            display.display(f"kvlab: play {name!r} ({pattern}) has no host in {inventory}: nothing rendered for it")
            return
        display.error(
            f"play {name!r} matches no host: its hosts {pattern!r} are empty in {inventory}; "
            "add the hosts to that group (a play that configures nothing must not pass)"
        )
        # A callback's exceptions are turned into warnings by Ansible; SystemExit is not an
        # Exception, so it ends ansible-playbook here (its finally: blocks still clean up).
        sys.exit(EXIT_NO_HOSTS)
