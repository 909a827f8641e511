"""The runner's grammar matchers (llguidance): one per constrained request.

- A constraint compiles on a worker thread. The scheduler orders it by key before any
  request waiting for it is scheduled (``order``, from
  ``SchedulerOutput.grammar_compiles``) and admits those requests once a step's output
  reported it compiled (``report``: core/grammar_gate.py), so no step waits for a
  compile. Compiled grammars are kept by ``StructuredOutputsParams.key()`` until the
  scheduler evicts them (``evict``): it admits a request whose key is compiled at once,
  so the key must still be here when the request arrives. A request keeps its compiled
  grammar until it finishes (a preempted one comes back to it) and gets a copy of it as
  its matcher (the lexer automaton llguidance builds lazily is shared by the copies). A
  request the runner sees with no compile (a runner driven directly) compiles at ``add``
  and its first sample waits for it.
- Each step, every constrained row's allowed tokens are filled into one packed int32
  bitmask (llguidance's layout: bit i of word j allows token 32 j + i) and applied to
  the logits in one pass over the constrained rows (``apply_mask``). The runner starts
  the fill on the mask thread before the forward pass (``start_mask``): the matchers'
  states are final when a step starts, so the fill runs beside the model, and the step
  takes the result after the logits (``take_mask``). Nothing else touches a matcher
  while a fill is out: every other entry point settles it first.
- A matcher advances on the tokens the step accepted (``accept``). After a preemption the
  request comes back as new with its output so far: a fresh copy replays it, so the
  matcher is right whatever happened in between; each sample of n > 1 is its own request.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from conveyor.kernels.cpu.token_bitmask import apply_token_bitmask
from conveyor.structured_outputs import StructuredOutputsParams


class GrammarError(RuntimeError):
    """A matcher refused a token the sampler was allowed to pick (a bug, never input)."""


class Grammars:
    def __init__(self, tokenizer_path: str | None, vocab_size: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        # llguidance's view of the vocabulary, built in the background from ``prepare``
        # (the executor calls it once the runner's start-up measurements are done; a
        # draft model's runner never does): a tokenizer it cannot read is then known
        # before any request is accepted.
        self._tokenizer_future: Future | None = None
        # Constraint key -> its compile (kept until the scheduler evicts it).
        self._compiled: dict[str, Future] = {}
        # Request id -> its matcher, or (the compile's future, output tokens to replay).
        self._matchers: dict[str, object] = {}
        # Request id -> its compile, from its first add until it finishes; and the ordered
        # compiles (by key) whose outcome the scheduler has not been told yet.
        self._compiles: dict[str, Future] = {}
        self._unreported: dict[str, Future] = {}
        self._executor = None
        # The step's bitmask fill, started before the forward pass (start_mask).
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._pending: Future | None = None
        # Figures for benchmarks/structured: each compile's seconds (on its thread), and
        # the seconds a step waited for a compile still running at its first sample.
        self.compile_s: list[float] = []
        self.wait_s = 0.0
        self.num_waits = 0
        # Seconds of the bitmask fills (on the mask thread, beside the forward pass).
        self.fill_s = 0.0

    def prepare(self) -> None:
        """Start building llguidance's tokenizer in the background (once). The packages
        that build imports are imported here first, on the caller's thread: a package
        imported by two threads at once can fail in one of them ("partially initialized
        module"), as ``tokenizers`` did while the engine loaded its own tokenizer."""
        with self._lock:
            if self._tokenizer_future is None:
                _import_llg_tokenizer_deps()
                self._tokenizer_future = self._pool.submit(self._llg_tokenizer)

    @property
    def _tokenizer(self) -> Future:
        self.prepare()
        return self._tokenizer_future

    def unsupported(self) -> str | None:
        """Why this model cannot take structured outputs (None: it can)."""
        try:
            self._tokenizer.result()
        except Exception as e:  # llguidance cannot read the tokenizer, or there is none
            return str(e)
        return None

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._matchers

    # ---- requests ------------------------------------------------------------------------
    def order(self, key: str, params: StructuredOutputsParams) -> None:
        """Start the compile of a constraint (``key``: ``params.key()``) that requests wait
        for; ``report`` tells when it ended. Kept until ``evict``."""
        self._unreported[key] = self._compile_future(key, params)

    def evict(self, key: str) -> None:
        """Drop a compiled grammar (requests holding it keep their copy)."""
        with self._lock:
            self._compiled.pop(key, None)
        self._unreported.pop(key, None)

    def report(self, ready: list[str], errors: dict[str, str], wait_s: float = 0.0) -> None:
        """Append the ordered compiles that ended since the last report (keys to ``ready``,
        key -> why to ``errors``). ``wait_s``: wait up to that long for one to end first
        (an empty step, which has nothing else to do)."""
        if not self._unreported:
            return
        if wait_s > 0:
            wait(list(self._unreported.values()), timeout=wait_s, return_when=FIRST_COMPLETED)
        for key, future in list(self._unreported.items()):
            if future.done():
                del self._unreported[key]
                error = future.exception()
                if error is None:
                    ready.append(key)
                else:
                    errors[key] = str(error)

    def add(self, req_id: str, params: StructuredOutputsParams, output_token_ids: list[int]
            ) -> None:
        """A request scheduled: its matcher is made at first use from its compile (kept
        from before a preemption, the cached one, else one started now)."""
        self._settle()
        future = self._compiles.get(req_id)
        if future is None:
            future = self._compiles[req_id] = self._compile_future(params.key(), params)
        self._matchers[req_id] = (future, list(output_token_ids))

    def drop(self, req_id: str, finished: bool = True) -> None:
        """Forget a request's matcher; its compile too unless it was only preempted."""
        self._settle()
        self._matchers.pop(req_id, None)
        if finished:
            self._compiles.pop(req_id, None)

    def _compile_future(self, key: str, params: StructuredOutputsParams) -> Future:
        # The scheduler decides what the cache keeps (core/grammar_gate.py: ``evict``).
        self.prepare()  # the tokenizer queued ahead of the compile that needs it
        with self._lock:
            future = self._compiled.get(key)
            if future is None:
                future = self._compiled[key] = self._pool.submit(self._compile, params)
        return future

    def _settle(self) -> None:
        """Wait for a fill still out (a step that failed before taking it): its matchers
        must not change under it. Its result, or error, goes with the failed step."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.exception()

    def ready(self, req_id: str) -> bool:
        entry = self._matchers.get(req_id)
        return not isinstance(entry, tuple) or entry[0].done()

    def accept(self, req_id: str, tokens: list[int]) -> None:
        self._settle()
        matcher = self._matcher(req_id)
        for token in tokens:
            if matcher.is_stopped() and token in self.eos_token_ids:
                return  # the grammar ended and its mask let only EOS through: it stops
            if not matcher.consume_token(token):
                raise GrammarError(f"request {req_id}: the grammar refused token {token} "
                                   f"of {tokens} ({matcher.get_error()})")

    # ---- the step ------------------------------------------------------------------------
    def start_mask(self, rows: list[tuple[int, str]], drafts: dict[str, list[int]] | None = None
                   ) -> None:
        """``fill(rows, drafts)`` on the mask thread, beside the forward pass."""
        self._settle()
        self._pending = self._mask_pool.submit(self.fill, rows, drafts)

    def take_mask(self) -> StepMask:
        """The fill ``start_mask`` started (raising its error, if any)."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("no bitmask fill was started for this step")
        return pending.result()

    def mask(self, logits: torch.Tensor, rows: list[tuple[int, str]],
             drafts: dict[str, list[int]] | None = None) -> torch.Tensor:
        """float32 logits with every token a row's grammar forbids at -inf (``fill``
        computed here, then applied)."""
        logits = logits.float()
        if not rows:
            return logits
        self._settle()
        return apply_mask(logits, self.fill(rows, drafts))

    def fill(self, rows: list[tuple[int, str]], drafts: dict[str, list[int]] | None = None
             ) -> StepMask:
        """The packed bitmask of the constrained rows. ``rows``: (logits row, request id)
        of the constrained rows, a request's rows consecutive; unconstrained rows have no
        mask row and are left alone. The first row of each request is filled by
        llguidance's parallel executor; a request verifying ``drafts`` has a row per draft
        position, each filled after the drafts before it (its matcher advances over them,
        then rolls back: the step accepts what verification keeps). A draft the grammar
        refuses gets probability 0 at its row, so it is rejected; the rows after it repeat
        that row's mask (they are never sampled from)."""
        import llguidance

        t0 = time.perf_counter()
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        words = (self.vocab_size + 31) // 32
        bitmask = torch.empty((len(rows), words), dtype=torch.int32)
        firsts = [j for j, (_, rid) in enumerate(rows) if j == 0 or rows[j - 1][1] != rid]
        # llguidance.torch's fill, called directly: that module imports triton where it is
        # installed, which a CPU engine has no use for.
        self._executor.unsafe_compute_mask_ptr(
            [(self._matcher(rows[j][1]), j) for j in firsts], bitmask.data_ptr(), words * 4,
            len(rows))
        for j in firsts:
            rid = rows[j][1]
            if drafts and drafts.get(rid):
                self._fill_drafts(self._matcher(rid), drafts[rid], bitmask, j)
        empty = ~bitmask.numpy().any(axis=1)
        if empty.any():
            bad = [rid for j, (_, rid) in enumerate(rows) if empty[j]]
            raise GrammarError(f"no token is allowed for {bad}")
        self.fill_s += time.perf_counter() - t0
        return StepMask(bitmask, torch.tensor([i for i, _ in rows], dtype=torch.int64))

    @staticmethod
    def _fill_drafts(matcher, drafts: list[int], bitmask: torch.Tensor, first: int) -> None:
        # Only the prefix the grammar takes is consumed: a refused token would leave the
        # matcher in error, which no rollback undoes.
        valid = matcher.validate_tokens(drafts)
        for k in range(len(drafts)):
            row = first + k + 1
            if k < valid and matcher.consume_token(drafts[k]):
                _fill_row(matcher, bitmask, row)
            else:
                bitmask[row] = bitmask[row - 1]
        if valid:
            matcher.rollback(valid)

    # ---- compile -------------------------------------------------------------------------
    def _matcher(self, req_id: str):
        entry = self._matchers[req_id]
        if isinstance(entry, tuple):
            future, replay = entry
            if not future.done():  # (a request never ordered: a step waits for it)
                t0 = time.perf_counter()
                future.exception()
                self.wait_s += time.perf_counter() - t0
                self.num_waits += 1
            template = future.result()  # raises the compile's error, if any
            entry = template.deep_copy()
            if replay and not entry.consume_tokens(replay):
                raise GrammarError(f"request {req_id}: its output so far does not match "
                                   f"its grammar ({entry.get_error()})")
            self._matchers[req_id] = entry
        return entry

    def _compile(self, params: StructuredOutputsParams):
        import llguidance

        tokenizer = self._tokenizer.result()
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, params.grammar_text())
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind}: {matcher.get_error()}")
        matcher.compute_bitmask()  # builds the first state's automaton here, not in a step
        self.compile_s.append(time.perf_counter() - t0)
        return matcher

    def _llg_tokenizer(self):
        import llguidance.hf
        from transformers import AutoTokenizer

        if self.tokenizer_path is None:
            raise ValueError("this model has no tokenizer")
        hf = AutoTokenizer.from_pretrained(self.tokenizer_path)
        return llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size,
                                            eos_token=self.eos_token_ids or None)


def _import_llg_tokenizer_deps() -> None:
    """Import what ``Grammars._llg_tokenizer`` needs (a package missing is its error to
    report, on its thread)."""
    for name in ("tokenizers", "llguidance.hf", "transformers.models.auto.tokenization_auto"):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


@dataclass
class StepMask:
    """A step's grammar mask: llguidance's packed int32 bitmask of the constrained rows
    (bit i of word j allows token 32 j + i) and the logits row each one applies to."""

    bitmask: torch.Tensor  # int32 [constrained rows, ceil(vocab / 32)]
    rows: torch.Tensor  # int64 [constrained rows]


def apply_mask(logits: torch.Tensor, mask: StepMask) -> torch.Tensor:
    """float32 logits with each constrained row's forbidden tokens at -inf, in place (the
    logits are the step's own), straight from the packed bitmask: one native pass over
    the constrained rows only (kernels/cpu/token_bitmask.py); on another device the
    bitmask is unpacked there."""
    logits = logits.float()
    if logits.device.type == "cpu":
        return apply_token_bitmask(logits, mask.bitmask, mask.rows)
    bits = (mask.bitmask.to(logits.device).unsqueeze(-1)
            >> torch.arange(32, device=logits.device, dtype=torch.int32)) & 1
    allowed = bits.view(len(mask.rows), -1)[:, :logits.shape[1]].bool()
    rows = mask.rows.to(logits.device)
    logits[rows] = logits[rows].masked_fill_(~allowed, float("-inf"))
    return logits


def _fill_row(matcher, bitmask: torch.Tensor, row: int) -> None:
    """One matcher's allowed tokens into ``bitmask[row]`` (int32 words, contiguous)."""
    view = bitmask[row]
    matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())
