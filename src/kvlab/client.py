"""A streaming client for vLLM's OpenAI-compatible completions API, measured at the client.

Prompts are token ids, so a prompt's blocks are exact and reproducible. The time to first
token is taken when the first streamed token arrives; gaps between tokens are kept so
that frozen answers can be found.
"""

from __future__ import annotations

import http.client
import json
import os
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse


@dataclass
class Completion:
    ttft_s: float
    total_s: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int | None
    text: str
    token_gaps_s: list[float] = field(default_factory=list)
    # The generated token ids, where asked for (return_token_ids) and the engine sent them.
    token_ids: list[int] | None = None

    @property
    def max_gap_s(self) -> float:
        return max(self.token_gaps_s, default=0.0)


def complete(
    base_url: str,
    model: str,
    prompt_ids: list[int],
    max_tokens: int = 1,
    cache_salt: str | None = None,
    timeout_s: float = 1800,
    api_key: str | None = None,
    return_token_ids: bool = False,
) -> Completion:
    url = urlparse(base_url)
    body: dict = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if cache_salt:
        body["cache_salt"] = cache_salt
    if return_token_ids:  # vLLM's extension: each streamed choice carries its token ids
        body["return_token_ids"] = True
    headers = {"Content-Type": "application/json"}
    if api_key is None:
        # The variable vLLM's own server reads for --api-key: a lab engine behind a key is
        # measured with the key in the environment, never on a command line.
        api_key = os.environ.get("VLLM_API_KEY")
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"completion failed: HTTP {resp.status}: {resp.read()[:500]!r}")
    first: float | None = None
    last = t0
    gaps: list[float] = []
    text: list[str] = []
    ids: list[int] | None = None
    n_out = 0
    usage: dict = {}
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices", []):
            if choice.get("text") is None:
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
            n_out += 1
            text.append(choice["text"])
            if choice.get("token_ids") is not None:
                if ids is None:
                    ids = []
                ids.extend(choice["token_ids"])
    total = time.perf_counter() - t0
    conn.close()
    details = usage.get("prompt_tokens_details") or {}
    return Completion(
        ttft_s=(first or time.perf_counter()) - t0,
        total_s=total,
        output_tokens=usage.get("completion_tokens", n_out),
        prompt_tokens=usage.get("prompt_tokens", len(prompt_ids)),
        cached_tokens=details.get("cached_tokens"),
        text="".join(text),
        token_gaps_s=gaps,
        token_ids=ids,
    )
