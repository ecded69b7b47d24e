"""Where a campaign's agents scenario takes its turns from (its `agents.source`), as the campaign
file says it: seeded coding-agent sessions, or a Mooncake trace.

Each compiles to the plan's spec of it (kvlab.harness.sessions: GeneratorSpec, MooncakeSpec),
which is what the sessions generate from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from kvlab.harness.campaign_base import CampaignFile, Strict, resolve_file
from kvlab.harness.sessions import GeneratorSpec, MooncakeSpec, SourceSpec


class GeneratorSource(Strict):
    """Seeded coding-agent-like sessions: a growing context, tool outputs, think time."""

    turns: int | dict[int, int] = Field(
        6,
        description="turns each agent sends; or per concurrency ({8: 6, 16: 5, 32: 4}): the more agents, the "
        "fewer turns each needs for the step's sample of returning turns",
    )
    system_tokens: int = Field(1024, ge=1)
    first_user_tokens: int = Field(128, ge=1)
    tool_output_tokens: tuple[int, int] = (256, 1024)
    assistant_tokens: tuple[int, int] = Field(
        (32, 128), description="length of each seeded reply (answers: seeded only)"
    )
    output_tokens: tuple[int, int] = (32, 128)
    think_time_s: tuple[float, float] = (0.5, 2.0)
    answers: Literal["seeded", "engine"] = Field(
        "seeded",
        description="seeded: each next turn carries a seeded reply in place of the answer, so every "
        "prompt is known before the run; engine: it carries the tokens the engine generated for the previous "
        "turn, as an agent framework sends them back",
    )

    @field_validator("turns")
    @classmethod
    def _turns(cls, v: int | dict[int, int]) -> int | dict[int, int]:
        if any(t < 2 for t in (v.values() if isinstance(v, dict) else [v])):
            raise ValueError("an agent sends at least 2 turns (one returning), got " + repr(v))
        return v

    @field_validator("tool_output_tokens", "assistant_tokens", "output_tokens", "think_time_s")
    @classmethod
    def _range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if v[0] < 0 or v[0] > v[1]:
            raise ValueError(f"a range is [low, high] with 0 <= low <= high, got {list(v)}")
        return v

    def spec(self, agents: int) -> GeneratorSpec:
        """The sessions of a step of `agents` agents (AgentsScenario checks that a mapping of
        turns names every concurrency)."""
        turns = self.turns if isinstance(self.turns, int) else self.turns[agents]
        return GeneratorSpec(**{**self.model_dump(), "turns": turns})


class MooncakeSource(Strict):
    """A trace in the Mooncake format; equal hash ids become equal token blocks."""

    path: CampaignFile
    start: int = Field(0, ge=0, description="first line replayed (0-based)")
    limit: int = Field(50, ge=1, description="lines replayed")
    block_tokens: int = Field(32, ge=1, description="tokens per hash id here (the trace's own: 512)")
    trace_block_tokens: int = Field(512, ge=1)
    time_scale: float = Field(
        0.1, ge=0, description="seconds here per second of the trace (timestamps are ms)"
    )
    max_output_tokens: int = Field(32, ge=1)

    def spec(self, base: Path | None = None) -> MooncakeSpec:
        """The plan's slice: the path resolved as the run resolves it (`base`: the campaign's folder)."""
        return MooncakeSpec(**{**self.model_dump(), "path": resolve_file(self.path, base)})


class AgentSource(Strict):
    generator: GeneratorSource | None = None
    mooncake: MooncakeSource | None = None

    @model_validator(mode="after")
    def _one(self) -> AgentSource:
        if (self.generator is None) == (self.mooncake is None):
            raise ValueError("give exactly one of 'generator: {...}' or 'mooncake: {...}'")
        return self

    def spec(self, agents: int, base: Path | None = None) -> SourceSpec:
        """What a step of `agents` agents replays; `base` resolves a trace's path."""
        if self.generator is not None:
            return self.generator.spec(agents)
        assert self.mooncake is not None
        return self.mooncake.spec(base)
