"""The error of an input a user gave: a campaign, a trace it names, a model folder, the host."""

from __future__ import annotations


class InputError(ValueError):
    """An input a user gave that cannot be used; the message is one line that names it and the fix."""
