"""The campaign file: setups x scenarios x parameters, with seeds, validated by pydantic.

Any mistake is reported in one line that names the file, the field and the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import posixpath
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from kvlab.harness.campaign_base import CampaignError, FileField, Strict, resolve_file
from kvlab.harness.campaign_sources import AgentSource
from kvlab.harness.sessions import agent_max_prompt_tokens, sha256_file
from kvlab.setups import registry as setups
from kvlab.wear import Drives

__all__ = ["Campaign", "CampaignError", "FileRef", "load", "parse", "resolve_file", "shipment"]


class TinyModel(Strict):
    """The locally generated random-weight model (`kvlab model tiny`): by default the
    KV-heavy one (16 KiB/token); `geometry` changes TinyGeometry's fields (a lighter model
    for long prompts)."""

    seed: int = 0
    geometry: dict[str, Any] = Field(
        default_factory=dict, description="TinyGeometry fields to change (kvlab.model), e.g. num_hidden_layers")

    @field_validator("geometry")
    @classmethod
    def _geometry_fields(cls, v: dict[str, Any]) -> dict[str, Any]:
        from kvlab.model import TinyGeometry

        try:
            TinyGeometry(**v).kv_bytes_per_token  # noqa: B018 - validates the dtype too
        except (TypeError, KeyError) as e:
            names = ", ".join(f.name for f in dataclasses.fields(TinyGeometry))
            raise ValueError(f"geometry: {e} (fields: {names})") from None
        return v

    def tiny_geometry(self) -> Any:
        from kvlab.model import TinyGeometry

        return TinyGeometry(**self.geometry)


class ModelSpec(Strict):
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


class RestoreScenario(Strict):
    """One long prompt: computed, restored after prefix-cache resets, then after restarts.

    Every engine first answers an unrelated warm-up request, so that no setup's compute pays
    for the engine's first request; the recompute every restore is set against is timed on
    one setup (`recompute_setup`, no cache) over `recompute_prompts` fresh prompts of the
    same length, one reference for all (a single cold compute per setup is noise)."""

    setups: list[str] | None = Field(
        None, description="which of the campaign's setups run this scenario (default: all of them)")
    tokens: int = Field(gt=0)
    warmup_tokens: int = Field(256, ge=1, description="the unrelated request each engine answers first")
    recompute_prompts: int = Field(3, ge=1, description="fresh prompts of `tokens` timed on recompute_setup")
    recompute_setup: str = Field(
        "baseline", description="the setup (no cache) that times the recompute reference; by default baseline, "
        "where it runs the restore (else no reference is timed)")
    warm_repeats: int = Field(3, ge=0)
    restart_repeats: int = Field(3, ge=0)
    output_tokens: int = Field(1, ge=1)
    drop_page_cache: bool = True
    settle_s: float = Field(2.0, ge=0, description="wait after the compute so asynchronous saves land")
    prefix_caching: bool = Field(
        True, description="off: no engine prefix cache to reset, and restore shares an engine life with "
        "the sweep and agents (fewer engine starts)")


class SweepScenario(Strict):
    """Context lengths x rounds of the same input; the mean of the chosen rounds."""

    setups: list[str] | None = Field(
        None, description="which of the campaign's setups run this scenario (default: all of them)")
    lengths: list[int] = Field(min_length=1)
    rounds: int = Field(10, ge=1)
    average_rounds: tuple[int, int] = Field((2, 9), description="first and last round averaged, 1-based")
    output_tokens: int = Field(16, ge=1)
    prefix_caching: bool = Field(False, description="the second seed turns vLLM's own prefix caching off")
    settle_s: float = Field(0.5, ge=0)
    drop_page_cache: bool = Field(
        False, description="drop the page cache before every round, so that a file-backed tier reads from its "
        "drive and not from host RAM (needs root; a refused drop is recorded)")

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


class AgentsScenario(Strict):
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

    @model_validator(mode="after")
    def _turns_per_concurrency(self) -> AgentsScenario:
        g = self.source.generator
        if g is not None and isinstance(g.turns, dict) and set(g.turns) != set(self.concurrency):
            raise ValueError(f"source.generator.turns gives turns for {sorted(g.turns)} agents and concurrency is "
                             f"{self.concurrency}: give one number per concurrency, or one number for all")
        return self


class Scenarios(Strict):
    restore: RestoreScenario | None = None
    sweep: SweepScenario | None = None
    agents: AgentsScenario | None = None


class MemorySampling(Strict):
    interval_s: float = Field(0.5, gt=0)


class DrivesSpec(Strict):
    """The drives the campaign's tiers write to, for the report's wear projection: the run's
    write rate as drive writes per day over their capacity, and the rated life it implies."""

    model: str | None = Field(None, description="what they are (for the report)")
    count: int = Field(ge=1, description="drives the store is spread over")
    capacity_tb: float = Field(gt=0, description="each drive's capacity, decimal TB")
    dwpd: float | None = Field(None, gt=0, description="rated drive writes per day over warranty_years")
    tbw: float | None = Field(None, gt=0, description="rated terabytes written, per drive")
    warranty_years: float = Field(5.0, gt=0, description="the period the rating covers")

    @model_validator(mode="after")
    def _one_rating(self) -> DrivesSpec:
        if (self.dwpd is None) == (self.tbw is None):
            raise ValueError("give exactly one rating: dwpd (drive writes per day, e.g. 1.0) or tbw "
                             "(terabytes written per drive, e.g. 14016)")
        return self

    def drives(self) -> Drives:
        return Drives(count=self.count, capacity_tb=self.capacity_tb, dwpd=self.dwpd, tbw=self.tbw,
                      warranty_years=self.warranty_years, model=self.model)


class Variant(Strict):
    """A lab parameter set the whole campaign repeats under (seed: storage link 100/400/800 Gb/s)."""

    name: str
    inventory_vars: dict[str, Any] = Field(default_factory=dict)


class Campaign(Strict):
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
    drives: DrivesSpec | None = Field(
        None, description="the drives' capacity and rated endurance: the report's drive writes per day and life")

    @field_validator("setups")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
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
        # The default (baseline) times the reference where it runs the restore, and no reference
        # is timed where it does not; a setup named on purpose must run it.
        if (s.restore is not None and "recompute_setup" in s.restore.model_fields_set
                and s.restore.recompute_setup not in (s.restore.setups or self.setups)):
            raise ValueError(f"scenarios.restore.recompute_setup: {s.restore.recompute_setup} does not run the "
                             "restore scenario: add it to the campaign's (and restore's) setups, or name one "
                             "without a cache that does")
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

    def files(self, base: Path | None = None) -> list[FileRef]:
        """Every file the campaign refers to (fields typed CampaignFile), resolved as the run
        resolves them; `base` is the campaign file's folder."""
        return [FileRef(where, value, resolve_file(value, base)) for where, value in _file_fields(self, "")]

    def max_prompt_tokens(self, base: Path | None = None) -> int:
        """The longest prompt any scenario sends (bounds max_model_len and the batch)."""
        s = self.scenarios
        n = 0
        if s.restore:
            n = max(n, s.restore.tokens)
        if s.sweep:
            n = max(n, *s.sweep.lengths)
        if s.agents:
            n = max(n, *(agent_max_prompt_tokens(s.agents.source.spec(a, base)) for a in s.agents.concurrency))
        return n


@dataclasses.dataclass(frozen=True)
class FileRef:
    """A file a campaign refers to: the field naming it, the value as written, where it is."""

    field: str
    value: str
    path: Path


def _file_fields(m: BaseModel, loc: str) -> Iterator[tuple[str, str]]:
    for name, info in type(m).model_fields.items():
        value, where = getattr(m, name), f"{loc}.{name}" if loc else name
        if any(isinstance(x, FileField) for x in info.metadata):
            if value is not None:
                yield where, value
        elif isinstance(value, BaseModel):
            yield from _file_fields(value, where)
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                if isinstance(v, BaseModel):
                    yield from _file_fields(v, f"{where}.{i}")


def shipment(path: Path) -> dict[str, Any]:
    """What a campaign needs on another host: itself and every file it refers to, each with
    the path it must have there relative to the campaign's copy (`dest`: the reference as
    written, so the copy is used unchanged) and its sha256 to check on arrival.

    Raises CampaignError naming the field for a file that is missing, or that a copy beside
    the campaign could not keep valid (absolute, or outside the campaign's folder)."""
    c, sha = load(path)
    out = {"campaign": {"field": "(the campaign)", "value": str(path), "src": str(path.resolve()),
                        "dest": path.name, "sha256": sha},
           "files": []}
    seen: set[str] = set()
    for ref in c.files(path.parent):
        dest = posixpath.normpath(Path(ref.value).as_posix())
        if Path(ref.value).is_absolute() or dest == ".." or dest.startswith("../"):
            raise CampaignError(
                f"{path}: {ref.field}: {ref.value} is {'absolute' if Path(ref.value).is_absolute() else 'outside'}"
                f" the campaign's folder: give it relative to the campaign file, inside its folder, "
                f"so that a copy of the campaign with its files beside it (make bench) still finds it")
        if not ref.path.is_file():
            raise CampaignError(f"{path}: {ref.field}: {ref.value}: no such file ({ref.path}): "
                                "fix the path (relative to the campaign file) or add the file")
        if dest in seen:  # two fields naming one file: shipped once
            continue
        seen.add(dest)
        out["files"].append({"field": ref.field, "value": ref.value, "src": str(ref.path.resolve()),
                             "dest": dest, "sha256": sha256_file(ref.path)})
    return out


def _where(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def one_line(path: Path | str, err: ValidationError) -> str:
    """A validation error as one line naming the field: `path: field: what to do`."""
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
        raise CampaignError(one_line(source, e)) from None


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
