"""Images built Nix-style: one orchestrator (kvlab.images.build), builders registered by module path."""


class ImageError(Exception):
    """A build that cannot go on; the message names the input and the fix."""
