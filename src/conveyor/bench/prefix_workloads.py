"""Workloads whose prompts share prefixes: multi-turn chats and prefix families.

    families = prefix_family_requests(...)    # F shared prefixes (system prompts), each
                                              # request one of them + its own question;
                                              # request i belongs to family i % F, so
                                              # families are interleaved in arrival order
    chat     = ChatSessions(...)              # closed loop: turn k+1's prompt is turn k's
    first    = chat.first_turns()             # prompt + the model's answer + a new user
    run_engine(first, follow_up=chat.follow_up)   # message, sent when turn k finishes

Token ids are deterministic functions of (seed, what, which), in
[FIRST_PROMPT_TOKEN, vocab_size), so two requests share exactly the prefixes the
workload gives them and nothing by accident.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from conveyor.bench.synthetic import LengthDist, arrival_times
from conveyor.bench.workload import FIRST_PROMPT_TOKEN, BenchRequest, WorkloadError

_PREFIX, _SUFFIX, _USER = 1, 2, 3  # streams of token ids


def _tokens(vocab_size: int, seed: int, stream: int, a: int, b: int, n: int) -> list[int]:
    rng = np.random.default_rng([seed, stream, a, b])
    return rng.integers(FIRST_PROMPT_TOKEN, vocab_size, n, dtype=np.int64).tolist()


def _check_vocab(vocab_size: int) -> None:
    if vocab_size <= FIRST_PROMPT_TOKEN + 1:
        raise WorkloadError(f"vocab_size {vocab_size} is too small for prompt tokens")


def prefix_family_requests(num_requests: int, num_families: int, prefix_len: int,
                           suffix_len: LengthDist, output_len: LengthDist, vocab_size: int, *,
                           rate: float = float("inf"), seed: int = 0) -> list[BenchRequest]:
    """Requests ``prefix(i % F) + own suffix``: one family is the shared-system-prompt
    workload; several, interleaved, are the case where arrival order thrashes a small
    cache and cache-aware ordering pays."""
    if num_requests < 1 or num_families < 1 or prefix_len < 0:
        raise WorkloadError(f"need num_requests >= 1, num_families >= 1, prefix_len >= 0; "
                            f"got {num_requests}, {num_families}, {prefix_len}")
    _check_vocab(vocab_size)
    rng = random.Random(seed)
    arrivals = arrival_times(num_requests, rate, 1.0, random.Random(seed + 1))
    prefixes = [_tokens(vocab_size, seed, _PREFIX, f, 0, prefix_len)
                for f in range(num_families)]
    reqs = []
    for i, t in enumerate(arrivals):
        suffix = _tokens(vocab_size, seed, _SUFFIX, i, 0, suffix_len.sample(rng))
        reqs.append(BenchRequest(f"f{i % num_families}-{i}", t,
                                 prefixes[i % num_families] + suffix, output_len.sample(rng)))
    return reqs


@dataclass
class ChatSessions:
    """``num_sessions`` conversations of ``num_turns`` turns each, run in closed loop.

    Turn 0 is an opening user message; turn k > 0 sends the whole conversation so far
    (turn k-1's prompt and the model's actual answer) plus a new user message,
    ``think_s`` seconds after turn k-1 finished. Sessions start at ``rate`` per second
    (inf: all at once). ``outputs`` collects every request's generated ids.
    """

    num_sessions: int
    num_turns: int
    first_len: LengthDist
    user_len: LengthDist
    answer_len: LengthDist
    vocab_size: int
    rate: float = float("inf")
    think_s: float = 0.0
    seed: int = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_sessions < 1 or self.num_turns < 1:
            raise WorkloadError(f"need num_sessions >= 1 and num_turns >= 1, got "
                                f"{self.num_sessions}, {self.num_turns}")
        if self.think_s < 0:
            raise WorkloadError(f"think_s must be >= 0, got {self.think_s}")
        _check_vocab(self.vocab_size)
        rng = random.Random(self.seed)
        # Every length is drawn up front, so the workload does not depend on timing.
        self._user_lens = [[(self.first_len if k == 0 else self.user_len).sample(rng)
                            for k in range(self.num_turns)] for _ in range(self.num_sessions)]
        self._answer_lens = [[self.answer_len.sample(rng) for _ in range(self.num_turns)]
                             for _ in range(self.num_sessions)]
        self._turn: dict[str, tuple[int, int]] = {}

    def max_tokens_per_session(self) -> int:
        return max(sum(u) + sum(a) for u, a in zip(self._user_lens, self._answer_lens))

    def _request(self, session: int, turn: int, history: list[int],
                 arrival_s: float) -> BenchRequest:
        rid = f"s{session}-t{turn}"
        self._turn[rid] = (session, turn)
        message = _tokens(self.vocab_size, self.seed, _USER, session, turn,
                          self._user_lens[session][turn])
        return BenchRequest(rid, arrival_s, history + message,
                            self._answer_lens[session][turn])

    def first_turns(self) -> list[BenchRequest]:
        starts = arrival_times(self.num_sessions, self.rate, 1.0, random.Random(self.seed + 1))
        return [self._request(s, 0, [], t) for s, t in enumerate(starts)]

    def follow_up(self, req: BenchRequest, output_ids: list[int],
                  finished_s: float) -> BenchRequest | None:
        """The next turn of ``req``'s session (None after the last), for ``run_engine``."""
        self.outputs[req.request_id] = list(output_ids)
        session, turn = self._turn[req.request_id]
        if turn + 1 >= self.num_turns:
            return None
        return self._request(session, turn + 1, req.prompt_token_ids + list(output_ids),
                             finished_s + self.think_s)


def output_recorder(outputs: dict[str, list[int]]):
    """A ``follow_up`` for open-loop workloads: records generated ids, adds nothing."""
    def record(req: BenchRequest, output_ids: list[int], finished_s: float) -> None:
        outputs[req.request_id] = list(output_ids)
    return record
