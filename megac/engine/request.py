"""A generation request inside the engine, and its output processing
(incremental detokenisation, stop strings, finish reasons).

Output processing runs in the engine thread right after each sampled token,
so a stop string frees the request's KV blocks at once. What the client sees
is a sequence of :class:`EngineOutput` events, each carrying the *text delta*
since the previous event; the non-streaming response is the concatenation of
the same deltas, so streamed and non-streamed text are identical.

Stop strings are never part of the output (unless
``include_stop_str_in_output``); while a request runs, the longest tail of
the text that is the beginning of a stop string is held back.

A request held to a grammar (structured output) carries its
:class:`~megac.grammar.GrammarMatcher`; the sampler advances it, and the
request finishes with ``stop`` once the grammar takes no further token
(``error`` if the matcher ever rejects a token, which the mask prevents).
The matcher lives with the request, so a preempted request resumes it where
it was: the replay feeds its tokens to the model only.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from megac.sampling import NoiseStream, SamplingParams, make_stream

if TYPE_CHECKING:
    from megac.grammar import GrammarMatcher

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Phase(enum.Enum):
    PREFILL = "prefill"  # prompt tokens not yet in the cache
    REPLAY = "replay"  # after a preemption: generated tokens re-run through decode
    DECODE = "decode"  # feed the last sampled token, sample the next


@dataclass
class EngineOutput:
    """One event for the API layer."""

    request_id: str
    text: str = ""  # text delta
    token_ids: list[int] = field(default_factory=list)  # tokens sampled since the last event
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: str | int | None = None  # the stop string or stop token id
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


class IncrementalDetokenizer:
    """Text deltas of a growing token list (prefix/read offsets: a token's
    text is emitted once the decoded window no longer ends in an incomplete
    UTF-8 sequence, shown by tokenizers as U+FFFD)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip)

    def step(self, token: int) -> str:
        self.ids.append(int(token))
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new = self._decode(self.ids[self.prefix_offset:])
        if len(new) > len(prefix) and not new.endswith("\ufffd"):
            delta = new[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held (at the end of the output)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new[len(prefix):] if len(new) > len(prefix) else ""


class Request:
    """One request: prompt, sampling parameters, engine state, output sink."""

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams, *, request_id: str | None = None,
                 tokenizer=None, eos_ids: Sequence[int] = (), sink: Callable[[EngineOutput], None] | None = None,
                 arrival_time: float | None = None, grammar: "GrammarMatcher | None" = None) -> None:
        self.id = request_id or f"req-{next(_ids)}"
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.params = params
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.sink = sink
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # engine state
        self.status = Status.WAITING
        self.output_ids: list[int] = []
        self.row: int | None = None
        self.num_computed = 0  # tokens of prompt+output whose K/V the row holds
        self.stream: NoiseStream = make_stream(params.seed)
        self.admit_seq = -1  # admission order (preemption victims: the latest)
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache (first admission)
        self.num_preemptions = 0
        self.admitted_once = False
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.aborted = False
        self.error: str | None = None  # why the request ended with "error"
        #: structured output: the matcher the sampler constrains this request with
        self.grammar = grammar
        #: keep the fp32 logits each output token was sampled from (``logits``): tools and tests
        self.keep_logits = False
        self.logits: list[torch.Tensor] = []
        # output processing
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens) if tokenizer else None
        self.text = ""  # all text so far (stop string cut applied at the end)
        self.emitted = 0  # characters of self.text already sent
        self._pending_ids: list[int] = []
        self._max_stop = max((len(s) for s in params.stop), default=0)

    # ------------------------------------------------------------------ state

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def phase(self) -> Phase:
        if self.num_computed < len(self.prompt_ids):
            return Phase.PREFILL
        if self.num_computed < self.num_tokens - 1:
            return Phase.REPLAY
        return Phase.DECODE

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def next_input(self) -> int:
        """The token a decode step feeds (REPLAY or DECODE phase)."""
        return self.all_ids[self.num_computed]

    # ------------------------------------------------------------------ output

    def append_token(self, token: int, max_model_len: int) -> EngineOutput | None:
        """Record a sampled token; returns the event to send (None: nothing
        to show yet). Sets ``finish_reason`` when the request is done."""
        token = int(token)
        self.output_ids.append(token)
        self._pending_ids.append(token)
        p = self.params
        n = len(self.output_ids)
        finished = False
        if token in p.stop_token_ids and n >= p.min_tokens:
            finished, self.finish_reason, self.stop_reason = True, "stop", token
        elif token in self.eos_ids and not p.ignore_eos and n >= p.min_tokens:
            finished, self.finish_reason = True, "stop"
        else:
            before = len(self.text)
            if self.detok is not None:
                self.text += self.detok.step(token)
            if p.stop and len(self.text) > before:
                if self._check_stop(before):
                    finished = True
            if not finished and self.grammar is not None and self.grammar.finished:
                # complete (before the length check: a grammar that ends on the
                # last allowed token completed), or the matcher broke
                self.error = self.grammar.error
                finished, self.finish_reason = True, "error" if self.error else "stop"
            if not finished and (n >= p.max_tokens or self.num_tokens >= max_model_len):
                finished, self.finish_reason = True, "length"
        if finished and self.detok is not None and not isinstance(self.stop_reason, str):
            # EOS, stop token or length: show what the detokenizer still holds
            before = len(self.text)
            self.text += self.detok.flush()
            if p.stop and len(self.text) > before:
                self._check_stop(before)
        return self._event(finished)

    def _check_stop(self, before: int) -> bool:
        """Search the new text (and the held-back tail) for a stop string."""
        start = max(0, before - self._max_stop + 1)
        best = None
        for s in self.params.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = self.text[: i + len(s)] if self.params.include_stop_str_in_output else self.text[:i]
        self.finish_reason, self.stop_reason = "stop", s
        return True

    def _partial_stop(self) -> int:
        """Length of the longest tail of the text that may start a stop string."""
        best = 0
        tail = self.text[max(self.emitted, len(self.text) - self._max_stop + 1):]
        for stop in self.params.stop:
            for n in range(min(len(stop) - 1, len(tail)), best, -1):
                if tail.endswith(stop[:n]):
                    best = n
                    break
        return best

    def _event(self, finished: bool) -> EngineOutput | None:
        if finished:
            upto = len(self.text)
        else:
            upto = len(self.text) - self._partial_stop()
        upto = max(upto, self.emitted)
        delta = self.text[self.emitted:upto]
        if not delta and not finished:
            return None
        self.emitted = upto
        ids, self._pending_ids = self._pending_ids, []
        return EngineOutput(self.id, delta, ids, finished, self.finish_reason if finished else None,
                            self.stop_reason if finished else None, len(self.prompt_ids), len(self.output_ids),
                            self.num_cached_tokens, self.error if finished else None)

    def final_event(self, reason: str, error: str | None = None) -> EngineOutput:
        """The closing event of an aborted or failed request."""
        self.finish_reason = reason
        ids, self._pending_ids = self._pending_ids, []
        return EngineOutput(self.id, "", ids, True, reason, None, len(self.prompt_ids), len(self.output_ids),
                            self.num_cached_tokens, error)

    def send(self, out: EngineOutput | None) -> None:
        if out is not None and self.sink is not None:
            self.sink(out)


__all__ = ["EngineOutput", "IncrementalDetokenizer", "Phase", "Request", "Status"]
