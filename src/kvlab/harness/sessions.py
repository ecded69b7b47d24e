"""Where the agents scenario's turns come from: seeded coding-agent sessions, or a Mooncake trace.

Prompts are token ids, reproducible from the seed: a prompt's blocks are exact, so two
prompts share KV exactly where they share a prefix. Every turn knows how many of its
leading tokens an earlier request already computed (`reusable_tokens`): that is what a
cache can return, and what the hit shares are measured against.

What a workload is made of comes from the plan (GeneratorSpec, MooncakeSpec, WorkloadSpec): the
compiler builds them from the campaign's sources (kvlab.harness.campaign_sources); nothing here
reads the campaign.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvlab.harness.errors import InputError

# Ids below 16 are left to special tokens; 8000 fits the tiny model's vocabulary and any real one.
TOKEN_LOW, TOKEN_HIGH = 16, 8000



# ---- the workloads a plan names (compiled from a campaign's `agents.source`) ------------
@dataclass(frozen=True)
class GeneratorSpec:
    """Seeded coding-agent-like sessions (the campaign's GeneratorSource says what each field is)."""

    turns: int
    system_tokens: int
    first_user_tokens: int
    tool_output_tokens: tuple[int, int]
    assistant_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    think_time_s: tuple[float, float]
    answers: Literal["seeded", "engine"]


@dataclass(frozen=True)
class MooncakeSpec:
    """A slice of a Mooncake trace, its path resolved (the campaign's MooncakeSource says what each field is)."""

    path: Path
    start: int
    limit: int
    block_tokens: int
    trace_block_tokens: int
    time_scale: float
    max_output_tokens: int


SourceSpec = GeneratorSpec | MooncakeSpec


@dataclass(frozen=True)
class WorkloadSpec:
    """One agents step's workload: its source, how many agents, the seed and the step's name
    (the key its seeded prompts derive from)."""

    source: SourceSpec
    agents: int
    seed: int
    step: str


def token_ids(key: str, n: int) -> list[int]:
    """n token ids, the same for the same key in every process (random.Random seeds str by sha512)."""
    rng = random.Random(key)
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]


@dataclass(frozen=True)
class TurnSpec:
    session: int
    index: int  # turn number within its session
    prompt: tuple[int, ...]
    max_tokens: int
    think_s: float = 0.0  # pause after the session's previous turn (agents think, tools run)
    at_s: float | None = None  # or: send at this offset from the step's start (trace replay)
    reusable_tokens: int = 0
    # answers: engine. `prompt` is only what this turn sends after the previous turn's prompt
    # and the engine's answer to it (the tool's output): the whole prompt, and how much of it
    # is reusable, are known once that answer is (`sent`).
    after_answer: bool = False

    def sent(self, previous_prompt: tuple[int, ...] | None, answer: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
        """The prompt this turn sends and its reusable tokens, given the session's previous
        prompt and the tokens the engine generated for it (unused unless after_answer)."""
        if not self.after_answer:
            return self.prompt, self.reusable_tokens
        if previous_prompt is None:
            raise ValueError(f"turn {self.index} of session {self.session} carries the previous answer, "
                             "and there is none")
        # The engine computed KV for the previous prompt and for every answer token but the
        # last: that one was sampled and never fed through the model.
        return previous_prompt + answer + self.prompt, len(previous_prompt) + max(0, len(answer) - 1)


@dataclass(frozen=True)
class Workload:
    """Per agent, the turns it sends one after the other."""

    agents: tuple[tuple[TurnSpec, ...], ...]

    @property
    def turns(self) -> list[TurnSpec]:
        return [t for a in self.agents for t in a]


def coding_agent_sessions(src: GeneratorSpec, n_agents: int, seed: int, step: str) -> Workload:
    """One session per agent: system prompt, a user request, then tool outputs appended each turn.

    The system prompt is shared by the step's agents (as a coding agent's is); turn k's
    prompt extends turn k-1's by the assistant's reply and a tool's output, so everything
    turn k-1 computed is reusable. With answers: seeded the replies are seeded tokens, not
    the model's output, so every prompt is known in advance; with answers: engine a reply is
    what the engine generated for turn k-1 (TurnSpec.after_answer). Both draw the same
    lengths, think times and tool outputs from the seed.
    """
    system = token_ids(f"{seed}:{step}:system", src.system_tokens)
    engine_answers = src.answers == "engine"
    agents = []
    for a in range(n_agents):
        rng = random.Random(f"{seed}:{step}:agent{a}")
        context = system + token_ids(f"{seed}:{step}:agent{a}:user", src.first_user_tokens)
        turns = []
        prev_len = 0
        for k in range(src.turns):
            sent = context
            if k > 0:
                reply = token_ids(f"{seed}:{step}:agent{a}:reply{k}", rng.randint(*src.assistant_tokens))
                tool = token_ids(f"{seed}:{step}:agent{a}:tool{k}", rng.randint(*src.tool_output_tokens))
                context = context + reply + tool
                sent = tool if engine_answers else context
            turns.append(TurnSpec(
                session=a, index=k, prompt=tuple(sent),
                max_tokens=rng.randint(*src.output_tokens),
                think_s=rng.uniform(*src.think_time_s) if k > 0 else 0.0,
                reusable_tokens=0 if engine_answers and k > 0 else prev_len,
                after_answer=engine_answers and k > 0,
            ))
            prev_len = len(context)
        agents.append(tuple(turns))
    return Workload(tuple(agents))


def generator_max_prompt_tokens(src: GeneratorSpec) -> int:
    # with answers: engine a reply is the previous turn's answer, of up to output_tokens
    reply = src.output_tokens[1] if src.answers == "engine" else src.assistant_tokens[1]
    return src.system_tokens + src.first_user_tokens + (src.turns - 1) * (reply + src.tool_output_tokens[1])


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_mooncake(path: Path, start: int, limit: int) -> list[TraceRequest]:
    """Lines start..start+limit of a Mooncake trace (timestamp, input_length, output_length, hash_ids)."""
    out: list[TraceRequest] = []
    try:
        with open(path) as f:
            for i, line in enumerate(f):
                if i < start:
                    continue
                if len(out) >= limit:
                    break
                try:
                    r = json.loads(line)
                    out.append(TraceRequest(float(r["timestamp"]), int(r["input_length"]),
                                            int(r["output_length"]), tuple(int(h) for h in r["hash_ids"])))
                except (ValueError, KeyError, TypeError) as e:
                    raise InputError(f"{path}:{i + 1}: not a Mooncake record "
                                        f"(timestamp, input_length, output_length, hash_ids): {e}") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read the trace: {e.strerror}") from None
    if not out:
        raise InputError(f"{path}: no records from line {start}: lower 'start'")
    return out


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def mooncake_workload(src: MooncakeSpec, n_agents: int, seed: int) -> Workload:
    """Replay a slice: equal hash ids become equal blocks of `block_tokens` ids.

    Lengths are scaled by block_tokens / trace_block_tokens; timestamps by time_scale. The
    requests go round-robin to n_agents workers, each sending its requests in order, none
    before its scaled timestamp: at most n_agents in flight.
    """
    reqs = read_mooncake(src.path, src.start, src.limit)
    t0 = reqs[0].timestamp_ms
    seen: set[int] = set()
    per_agent: list[list[TurnSpec]] = [[] for _ in range(n_agents)]
    for i, r in enumerate(reqs):
        cap = len(r.hash_ids) * src.block_tokens
        n = max(1, min(cap, round(r.input_length * src.block_tokens / src.trace_block_tokens)))
        prompt: list[int] = []
        for h in r.hash_ids:
            prompt += token_ids(f"mooncake:{seed}:{h}", src.block_tokens)
        prompt = prompt[:n]
        lead = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            lead += 1
        seen.update(r.hash_ids)
        a = i % n_agents
        per_agent[a].append(TurnSpec(
            session=i, index=0, prompt=tuple(prompt),
            max_tokens=max(1, min(r.output_length, src.max_output_tokens)),
            at_s=(r.timestamp_ms - t0) / 1000 * src.time_scale,
            reusable_tokens=min(lead * src.block_tokens, n),
        ))
    return Workload(tuple(tuple(a) for a in per_agent))


def workload(spec: WorkloadSpec) -> Workload:
    if isinstance(spec.source, GeneratorSpec):
        return coding_agent_sessions(spec.source, spec.agents, spec.seed, spec.step)
    return mooncake_workload(spec.source, spec.agents, spec.seed)


def agent_max_prompt_tokens(source: SourceSpec) -> int:
    if isinstance(source, GeneratorSpec):
        return generator_max_prompt_tokens(source)
    return max(len(t.prompt) for t in mooncake_workload(source, 1, 0).turns)
