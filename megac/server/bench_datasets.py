"""The prompt sets of ``megac bench-serve`` (vLLM's ``--dataset-name``).

``random``
    Prompts of ``--random-input-len`` tokens, words drawn from a fixed list
    and cut to length with the server's ``/tokenize``; output
    ``--random-output-len`` tokens. With ``--random-range-ratio R`` each
    request's lengths are drawn uniformly (integers) from
    ``[int(N*(1-R)), int(N*(1+R))]``, as vLLM does; R in [0, 1). An optional
    shared ``--random-prefix-len`` prefix goes in front of every prompt
    (exercises prefix caching). The lengths depend only on the seed, not
    on the tokenizer. Through ``/v1/completions`` the token ids themselves
    are sent, so input lengths are exact; through the chat endpoint the text
    is one user message and the chat template adds its own tokens.

``builtin``
    24 short real prompts shipped with megac (``data/bench_prompts.json``):
    12 coding tasks and 12 chat questions, each with its own output length
    (``--output-len`` overrides it). Taken in a seeded shuffle, repeated if
    more are asked for. The chat endpoint sends each as one user message;
    the completions endpoint sends the token ids of that same message
    rendered by the server's chat template (``/tokenize`` with
    ``messages``), so both endpoints run the same prompt tokens and the
    instruct model sees the prompt the way it was trained to.

``prompts``
    The user's own ``--prompt`` / ``--prompt-file`` texts, cycled, sent as
    they are, each with ``--output-len`` tokens.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI imports DATASETS for its help; httpx is only needed to run
    import httpx

DATASETS = ("random", "builtin", "prompts")
BUILTIN_FILE = "data/bench_prompts.json"
BUILTIN_KINDS = ("code", "chat")

WORDS = (
    "the of and to in is was for on that with as by at from it be this are or an have not which one had "
    "they you were their all we can has more when there been if would who will into time about other its "
    "some could them these two may then do first any my now such like our over only new also after most "
    "made many where before through back years much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here between both "
    "life being under never day same another know while last might great old year off come since against "
    "go came right used take three house water small place around however home found light river system "
    "number city market music story garden winter summer morning evening bridge mountain window paper "
    "engine kernel memory cache token model batch stream server client request answer question reason"
).split()


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int  # tokens sent; 0 where only the server knows (its usage reports it)
    output_len: int
    kind: str = ""  # builtin: "code" or "chat"


@dataclass(frozen=True)
class BuiltinPrompt:
    kind: str
    prompt: str
    max_tokens: int


@dataclass
class DatasetConfig:
    """What a dataset needs from the command line (see the module docstring)."""
    name: str = "random"
    num_prompts: int = 10
    random_input_len: int = 64
    random_output_len: int = 64
    random_prefix_len: int = 0
    random_range_ratio: float = 0.0
    prompts: tuple[str, ...] = ()
    output_len: int | None = None  # None: builtin's own lengths, 64 for --dataset prompts
    seed: int = 0


class Server:
    """The server's tokenizer endpoints, as the datasets use them."""

    def __init__(self, client: httpx.AsyncClient, base: str, headers: dict) -> None:
        self.client, self.base, self.headers = client, base, headers

    async def _post(self, path: str, body: dict) -> dict[str, Any]:
        r = await self.client.post(f"{self.base}{path}", json=body, headers=self.headers)
        r.raise_for_status()
        return r.json()

    async def tokenize(self, text: str) -> list[int]:
        return (await self._post("/tokenize", {"prompt": text, "add_special_tokens": False}))["tokens"]

    async def tokenize_chat(self, text: str) -> list[int]:
        return (await self._post("/tokenize", {"messages": [{"role": "user", "content": text}]}))["tokens"]

    async def detokenize(self, ids: list[int]) -> str:
        return (await self._post("/detokenize", {"tokens": ids}))["prompt"]


# ---------------------------------------------------------------------------- random


def length_bounds(n: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's bounds for ``--random-range-ratio`` (never below one token)."""
    return max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))


def sample_lengths(rng: random.Random, n: int, range_ratio: float, count: int) -> list[int]:
    lo, hi = length_bounds(n, range_ratio)
    return [rng.randint(lo, hi) for _ in range(count)]


async def _ids_of_len(server: Server, rng: random.Random, n: int) -> list[int]:
    # Words are one token or more, so n + 8 words nearly always suffice at once.
    ids = await server.tokenize(" ".join(rng.choice(WORDS) for _ in range(n + 8)))
    while len(ids) < n:
        ids += await server.tokenize(" " + " ".join(rng.choice(WORDS) for _ in range(n)))
    return ids[:n]


async def random_requests(server: Server, cfg: DatasetConfig, as_tokens: bool) -> list[BenchRequest]:
    # Lengths come from their own stream so that they depend on the seed alone.
    lengths = random.Random(cfg.seed)
    input_lens = sample_lengths(lengths, cfg.random_input_len, cfg.random_range_ratio, cfg.num_prompts)
    output_lens = sample_lengths(lengths, cfg.random_output_len, cfg.random_range_ratio, cfg.num_prompts)
    words = random.Random(f"words-{cfg.seed}")
    prefix = await _ids_of_len(server, words, cfg.random_prefix_len) if cfg.random_prefix_len > 0 else []
    out = []
    for n_in, n_out in zip(input_lens, output_lens):
        ids = prefix + await _ids_of_len(server, words, n_in)
        prompt: str | list[int] = ids if as_tokens else await server.detokenize(ids)
        out.append(BenchRequest(prompt, len(ids), n_out))
    return out


# ---------------------------------------------------------------------------- builtin


def load_builtin() -> list[BuiltinPrompt]:
    text = resources.files("megac.server").joinpath(BUILTIN_FILE).read_text(encoding="utf-8")
    return [BuiltinPrompt(p["kind"], p["prompt"], int(p["max_tokens"])) for p in json.loads(text)["prompts"]]


def _seeded_cycle(items: list, num: int, seed: int) -> list:
    order = list(items)
    random.Random(seed).shuffle(order)
    return [order[i % len(order)] for i in range(num)]


async def builtin_requests(server: Server, cfg: DatasetConfig, as_tokens: bool) -> list[BenchRequest]:
    out = []
    for p in _seeded_cycle(load_builtin(), cfg.num_prompts, cfg.seed):
        output_len = cfg.output_len or p.max_tokens
        if as_tokens:
            ids = await server.tokenize_chat(p.prompt)
            out.append(BenchRequest(ids, len(ids), output_len, p.kind))
        else:
            out.append(BenchRequest(p.prompt, 0, output_len, p.kind))
    return out


# ---------------------------------------------------------------------------- user prompts


def user_requests(cfg: DatasetConfig) -> list[BenchRequest]:
    if not cfg.prompts:
        raise ValueError("--dataset prompts needs --prompt or --prompt-file")
    return [BenchRequest(cfg.prompts[i % len(cfg.prompts)], 0, cfg.output_len or 64) for i in range(cfg.num_prompts)]


async def build_requests(server: Server, cfg: DatasetConfig, as_tokens: bool) -> list[BenchRequest]:
    """The requests of one benchmark; ``as_tokens``: token-id prompts (the
    completions endpoint) rather than text."""
    if cfg.name == "random":
        return await random_requests(server, cfg, as_tokens)
    if cfg.name == "builtin":
        return await builtin_requests(server, cfg, as_tokens)
    if cfg.name == "prompts":
        return user_requests(cfg)
    raise ValueError(f"unknown dataset {cfg.name!r} (choose from {', '.join(DATASETS)})")


__all__ = ["BUILTIN_KINDS", "DATASETS", "BenchRequest", "BuiltinPrompt", "DatasetConfig", "Server", "build_requests",
           "length_bounds", "load_builtin", "sample_lengths"]
