"""What every part of the campaign schema shares: the strict model, the one-line error, and
the marker of fields that name a file.

It sits below the campaign (kvlab.harness.campaign) and the sources it names
(kvlab.harness.campaign_sources). Only the compiler (kvlab.harness.compiler) reads a campaign:
what runs a campaign takes the plan it compiles to (kvlab.harness.plan).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict

from kvlab.harness.errors import InputError


class CampaignError(InputError):
    """A campaign file a user wrote that cannot be used; the message is one line."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileField:
    """Marks a field whose value is a file the campaign reads on the host it runs on: absolute,
    or relative to the campaign file's folder. `Campaign.files` finds every such field, so
    whatever ships a campaign elsewhere (roles/bench_runner) ships these with it."""


CampaignFile = Annotated[str, FileField()]


def resolve_file(value: str, base: Path | None) -> Path:
    """A campaign's file: absolute; relative to the working folder where it exists there;
    else relative to the campaign file's folder (`base`)."""
    p = Path(value)
    if not p.is_absolute() and base is not None and not p.exists():
        p = base / p
    return p
