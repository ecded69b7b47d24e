"""The campaign file: setups x scenarios x parameters, with seeds, validated by pydantic.

Any mistake is reported in one line that names the file, the field and the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvlab import setups


class CampaignError(ValueError):
    """A campaign file a user wrote that cannot be used; the message is one line."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TinyModel(_Strict):
    """The locally generated KV-heavy random-weight model (`kvlab model tiny`)."""

    seed: int = 0


class ModelSpec(_Strict):
    tiny: TinyModel | None = None
    path: str | None = Field(None, description="a model folder on the engine host (lab)")
    served_name: str = "kvlab-model"
    kv_bytes_per_token: int | None = Field(
        None, description="KV bytes per token (for bytes moved and estimates); the tiny model's is known"
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.tiny is None) == (self.path is None):
            raise ValueError("give exactly one of 'tiny: {seed: N}' or 'path: /folder'")
        return self


class RestoreScenario(_Strict):
    """One long prompt: computed, restored after prefix-cache resets, then after restarts."""

    setups: list[str] | None = Field(
        None, description="which of the campaign's setups run this scenario (default: all of them)")
    tokens: int = Field(gt=0)
    warm_repeats: int = Field(3, ge=0)
    restart_repeats: int = Field(3, ge=0)
    output_tokens: int = Field(1, ge=1)
    drop_page_cache: bool = True
    settle_s: float = Field(2.0, ge=0, description="wait after the compute so asynchronous saves land")
    prefix_caching: bool = Field(
        True, description="off: no engine prefix cache to reset, and restore shares an engine life with "
        "the sweep and agents (fewer engine starts)")


class SweepScenario(_Strict):
    """Context lengths x rounds of the same input; the mean of the chosen rounds."""

    setups: list[str] | None = Field(
        None, description="which of the campaign's setups run this scenario (default: all of them)")
    lengths: list[int] = Field(min_length=1)
    rounds: int = Field(10, ge=1)
    average_rounds: tuple[int, int] = Field((2, 9), description="first and last round averaged, 1-based")
    output_tokens: int = Field(16, ge=1)
    prefix_caching: bool = Field(False, description="the second seed turns vLLM's own prefix caching off")
    settle_s: float = Field(0.5, ge=0)

    @field_validator("lengths")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(n <= 0 for n in v):
            raise ValueError("every length must be a positive token count")
        return v

    @model_validator(mode="after")
    def _rounds_fit(self) -> SweepScenario:
        first, last = self.average_rounds
        if not 1 <= first <= last <= self.rounds:
            raise ValueError(f"average_rounds {list(self.average_rounds)} must lie within 1..rounds={self.rounds}")
        return self


class GeneratorSource(_Strict):
    """Seeded coding-agent-like sessions: a growing context, tool outputs, think time."""

    turns: int = Field(6, ge=2)
    system_tokens: int = Field(1024, ge=1)
    first_user_tokens: int = Field(128, ge=1)
    tool_output_tokens: tuple[int, int] = (256, 1024)
    assistant_tokens: tuple[int, int] = (32, 128)
    output_tokens: tuple[int, int] = (32, 128)
    think_time_s: tuple[float, float] = (0.5, 2.0)

    @field_validator("tool_output_tokens", "assistant_tokens", "output_tokens", "think_time_s")
    @classmethod
    def _range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if v[0] < 0 or v[0] > v[1]:
            raise ValueError(f"a range is [low, high] with 0 <= low <= high, got {list(v)}")
        return v


class MooncakeSource(_Strict):
    """A trace in the Mooncake format; equal hash ids become equal token blocks."""

    path: str
    start: int = Field(0, ge=0, description="first line replayed (0-based)")
    limit: int = Field(50, ge=1, description="lines replayed")
    block_tokens: int = Field(32, ge=1, description="tokens per hash id here (the trace's own: 512)")
    trace_block_tokens: int = Field(512, ge=1)
    time_scale: float = Field(0.1, ge=0, description="seconds here per second of the trace (timestamps are ms)")
    max_output_tokens: int = Field(32, ge=1)


class AgentSource(_Strict):
    generator: GeneratorSource | None = None
    mooncake: MooncakeSource | None = None

    @model_validator(mode="after")
    def _one(self) -> AgentSource:
        if (self.generator is None) == (self.mooncake is None):
            raise ValueError("give exactly one of 'generator: {...}' or 'mooncake: {...}'")
        return self


class AgentsScenario(_Strict):
    """N concurrent agents replay multi-turn sessions while new turns are written."""

    setups: list[str] | None = Field(
        None, description="which of the campaign's setups run this scenario (default: all of them)")
    concurrency: list[int] = Field(min_length=1)
    source: AgentSource
    frozen_threshold_s: float = Field(20.0, gt=0, description="a gap between streamed tokens above this is frozen")
    hit_min_fraction: float = Field(
        0.5, gt=0, le=1, description="a returning turn is found in the cache when this share of its reusable prefix was cached"
    )
    prefix_caching: bool = Field(False, description="off: every hit comes from the tier under test")

    @field_validator("concurrency")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(n <= 0 for n in v):
            raise ValueError("every concurrency must be >= 1")
        return v


class Scenarios(_Strict):
    restore: RestoreScenario | None = None
    sweep: SweepScenario | None = None
    agents: AgentsScenario | None = None


class MemorySampling(_Strict):
    interval_s: float = Field(0.5, gt=0)


class Variant(_Strict):
    """A lab parameter set the whole campaign repeats under (seed: storage link 100/400/800 Gb/s)."""

    name: str
    inventory_vars: dict[str, Any] = Field(default_factory=dict)


class Campaign(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$")
    description: str = ""
    device: Literal["cpu", "cuda"] = "cpu"
    seed: int = 0
    model: ModelSpec
    engine: dict[str, Any] = Field(default_factory=dict, description="EngineParams fields for every setup")
    setups: list[str] = Field(min_length=1)
    scenarios: Scenarios
    memory: MemorySampling = MemorySampling()
    variants: list[Variant] = Field(default_factory=list)
    inventory: str | None = Field(None, description="the Ansible inventory a lab campaign runs against")

    @field_validator("setups")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        load_setup_plugins()
        unknown = [s for s in v if s not in setups.REGISTRY]
        if unknown:
            raise ValueError(f"unknown setup(s) {', '.join(unknown)}: registered are {', '.join(sorted(setups.REGISTRY))}")
        if len(set(v)) != len(v):
            raise ValueError("a setup is listed twice")
        return v

    @field_validator("engine")
    @classmethod
    def _engine_fields(cls, v: dict[str, Any]) -> dict[str, Any]:
        names = {f.name for f in dataclasses.fields(setups.EngineParams)}
        # The harness owns these per setup and per run.
        owned = {"model", "python", "port", "kv_store_paths", "example_storage_path", "kv_metrics_port",
                 "enable_prefix_caching", "device", "served_model_name", "cache_server_port", "cache_server_l2_path"}
        unknown = sorted(set(v) - names)
        if unknown:
            raise ValueError(f"unknown engine parameter(s) {', '.join(unknown)}: see `kvlab setup render --help`")
        taken = sorted(set(v) & owned)
        if taken:
            raise ValueError(f"engine parameter(s) {', '.join(taken)} are set by the harness per setup: remove them")
        return v

    @model_validator(mode="after")
    def _something(self) -> Campaign:
        s = self.scenarios
        if s.restore is None and s.sweep is None and s.agents is None:
            raise ValueError("scenarios: give at least one of restore, sweep, agents")
        for name in ("restore", "sweep", "agents"):
            sc = getattr(s, name)
            if sc is not None and sc.setups is not None:
                stray = [x for x in sc.setups if x not in self.setups]
                if stray:
                    raise ValueError(f"scenarios.{name}.setups: {', '.join(stray)} not in the campaign's setups "
                                     f"({', '.join(self.setups)}): add it there or drop it here")
        idle = [x for x in self.setups if not self.scenarios_for(x)]
        if idle:
            raise ValueError(f"setup(s) {', '.join(idle)} run no scenario: list them in a scenario's setups "
                             "or remove them from the campaign's")
        return self

    def scenarios_for(self, setup: str) -> list[str]:
        """The scenarios this setup runs, in the order they run."""
        s = self.scenarios
        return [name for name in ("restore", "sweep", "agents")
                if (sc := getattr(s, name)) is not None and (sc.setups is None or setup in sc.setups)]

    def max_prompt_tokens(self, base: Path | None = None) -> int:
        """The longest prompt any scenario sends (bounds max_model_len and the batch)."""
        from kvlab.harness.sessions import agent_max_prompt_tokens

        s = self.scenarios
        n = 0
        if s.restore:
            n = max(n, s.restore.tokens)
        if s.sweep:
            n = max(n, *s.sweep.lengths)
        if s.agents:
            n = max(n, agent_max_prompt_tokens(s.agents.source, base))
        return n


def load_setup_plugins() -> None:
    """Setups registered in other modules of the registry (LMCache's) join REGISTRY on import."""
    import importlib

    for mod in ("kvlab.setups_lmcache",):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


def _where(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def _one_line(path: Path | str, err: ValidationError) -> str:
    e = err.errors()[0]
    loc = _where(tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-"))))
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "extra_forbidden":
        msg = "unknown field: remove it or check its spelling (docs/results-schema.md lists the fields)"
    elif e["type"] == "missing":
        msg = "required field missing: add it"
    more = f" (and {len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"{path}: {loc}: {msg}{more}"


def parse(data: Any, source: Path | str = "<campaign>") -> Campaign:
    if not isinstance(data, dict):
        raise CampaignError(f"{source}: a campaign is a YAML mapping with name, model, setups, scenarios")
    try:
        return Campaign.model_validate(data)
    except ValidationError as e:
        raise CampaignError(_one_line(source, e)) from None


def load(path: Path) -> tuple[Campaign, str]:
    """The campaign and the sha256 of its file's bytes."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CampaignError(f"{path}: cannot read the campaign file: {e.strerror}") from None
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise CampaignError(f"{path}:{where}: not valid YAML: {getattr(e, 'problem', e)}") from None
    return parse(data, path), hashlib.sha256(raw).hexdigest()
