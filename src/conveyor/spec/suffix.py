"""Suffix-tree drafts for speculative decoding, after SuffixDecoding (Oliaro et al., 2024).

Two kinds of counted suffix tries, both of bounded depth:

* one per running request, over its own context (prompt + outputs so far), updated as the
  context grows;
* one global trie over the outputs of the last ``max_cached_requests`` finished
  requests (their prompts too where the proposer was not told the prompt's length),
  FIFO; an evicted request's counts come out exactly.

A draft: the longest suffix of the context (at most ``max_depth`` tokens, at least
``min_match``) that occurs in a trie followed by some token, then the most frequent child
again and again.  The draft's score is the sum of the cumulative probabilities of its
tokens (its expected accepted length, if the tokens are accepted with the trie's empirical
conditional probabilities); the higher-scoring draft of the two tries wins.

Representation.  A plain bounded-depth suffix trie holds up to ``len(seq) * depth`` nodes,
most of them on unary chains of substrings seen once.  Here only substrings seen at least
twice get a ``_Node``; a substring seen once is a ``_Leaf`` naming where its one occurrence
starts, and stands for its whole (unary) subtree: the rest of that occurrence, up to the
window.  Every operation reads a leaf's chain from the sequence itself, so the counts are
those of the plain trie.  Pure Python: no torch, no numpy.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

__all__ = ["SuffixProposer", "SuffixTrie"]


class _Node:
    """A substring that occurred at least twice (after an eviction: at least once)."""

    __slots__ = ("best", "children", "count", "total")

    def __init__(self, count: int = 0) -> None:
        self.children: dict[int, _Node | _Leaf] = {}
        # Occurrences of this node's string (unused at the root).
        self.count = count
        # Invariant: total == sum(c.count for c in children.values()), the occurrences
        # followed by a token inside the window. The denominator of a child's probability.
        self.total = 0
        # The most frequent child (ties: smallest token id), or None when not known; kept
        # exact under increments, dropped to None when the best child is decremented.
        self.best: int | None = None


class _Leaf:
    """A substring that occurs exactly once, with its whole unary subtree: the occurrence
    starting at ``seq[start]``, which runs to ``start + depth`` or the end of ``seq``.
    ``seq`` may still grow (a running request's own context): the chain grows with it."""

    __slots__ = ("seq", "start")
    count = 1  # read like _Node.count

    def __init__(self, seq: list[int], start: int) -> None:
        self.seq = seq
        self.start = start


_Pos = _Node | _Leaf  # a position in a trie: a node, or (with a depth) a point on a leaf chain


def _best(node: _Node) -> int:
    """The most frequent child's token, ties to the smallest id. ``node.children`` non-empty."""
    b = node.best
    if b is None:
        items = node.children.items()
        b = min(items, key=lambda kv: (-kv[1].count, kv[0]))[0]
        node.best = b
    return b


def _bump(node: _Node, tok: int, count: int) -> None:
    """Child ``tok`` of ``node`` just rose to ``count``: keep ``node.best`` exact."""
    b = node.best
    if b is None:
        if len(node.children) == 1:
            node.best = tok
    elif b != tok:
        bc = node.children[b].count
        if count > bc or (count == bc and tok < b):
            node.best = tok


class SuffixTrie:
    """Counted suffix trie of bounded ``depth`` over one or many token sequences.

    The string of every node is counted once per start position where it occurs (windows of
    ``depth`` tokens). Sequences handed to ``extend``/``insert`` are referenced, not copied:
    the caller must not change what was already inserted (appending is fine).
    """

    __slots__ = ("depth", "num_leaves", "num_nodes", "root")

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self.root = _Node()
        self.num_nodes = 0  # _Node objects, the root not counted
        self.num_leaves = 0

    def __len__(self) -> int:
        return self.num_nodes + self.num_leaves

    def extend(self, active: list[_Node], seq: list[int], pos: int) -> list[_Node]:
        """Add the occurrences that end at ``seq[pos]``; return the new active list.

        ``active[L]`` is the node of ``seq[pos-L:pos]`` for L = 0..r: exactly the suffixes
        of ``seq[:pos]`` that are explicit nodes (the set is suffix-closed, so they are the
        shortest r+1), r < depth. The longer suffixes are on leaf chains whose occurrence is
        the trailing one, so they grow by themselves. O(r) dict operations.
        """
        tok = seq[pos]
        depth = self.depth
        new = [self.root]
        for length, node in enumerate(active):
            child = node.children.get(tok)
            node.total += 1
            if child is None:
                node.children[tok] = _Leaf(seq, pos - length)
                self.num_leaves += 1
                _bump(node, tok, 1)
                continue  # and every longer suffix becomes a leaf too
            if type(child) is _Leaf:
                # Second occurrence: make the node explicit; the old occurrence's rest of
                # chain hangs under it as the same leaf (same start, one level deeper).
                nd = _Node(2)
                d = length + 1
                nxt = child.start + d
                if d < depth and nxt < len(child.seq):
                    nd.children[child.seq[nxt]] = child
                    nd.total = 1
                    nd.best = child.seq[nxt]
                else:
                    self.num_leaves -= 1
                node.children[tok] = nd
                self.num_nodes += 1
                child = nd
            else:
                child.count += 1
            _bump(node, tok, child.count)
            if length + 1 < depth:
                new.append(child)
        return new

    def insert(self, seq: list[int]) -> None:
        """Add every occurrence in ``seq``. O(len(seq) * r)."""
        active = [self.root]
        for pos in range(len(seq)):
            active = self.extend(active, seq, pos)

    def remove(self, seq: list[int]) -> None:
        """Take out exactly what ``insert(seq)`` added (``seq`` the same list, unchanged):
        counts go down, nodes and leaves at count 0 are dropped."""
        n = len(seq)
        depth = self.depth
        children: dict[int, _Node | _Leaf]
        for i in range(n):
            node = self.root
            attached = True  # False once the walk is inside a subtree already cut off
            for p in range(i, min(n, i + depth)):
                tok = seq[p]
                children = node.children
                child = children[tok]
                node.total -= 1
                if node.best == tok:
                    node.best = None
                if type(child) is _Leaf:
                    # The one occurrence left is this one (start i): the chain ends here.
                    del children[tok]
                    self.num_leaves -= 1
                    break
                child.count -= 1
                if child.count == 0:
                    # Every other occurrence under it is gone already; walking on removes
                    # the rest of this one, so the counters stay exact.
                    if attached:
                        del children[tok]
                    attached = False
                    self.num_nodes -= 1
                node = child

    def walk(self, seq: Sequence[int], lo: int, hi: int) -> _Pos | None:
        """The position of ``seq[lo:hi]`` (depth hi - lo), or None when it does not occur."""
        pos: _Pos = self.root
        depth = self.depth
        for d, p in enumerate(range(lo, hi)):
            nxt = _advance(pos, d, seq[p], depth)
            if nxt is None:
                return None
            pos = nxt
        return pos

    def counts(self) -> dict[tuple[int, ...], int]:
        """Every string the trie holds with its count, leaf chains spelled out. For tests."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self.root, ())]
        while stack:
            node, prefix = stack.pop()
            for tok, child in node.children.items():
                s = (*prefix, tok)
                if type(child) is _Leaf:
                    seq, start = child.seq, child.start
                    end = min(len(seq), start + self.depth)
                    for j in range(start + len(s), end + 1):
                        out[tuple(seq[start:j])] = 1
                else:
                    out[s] = child.count
                    stack.append((child, s))
        return out


def _advance(pos: _Pos, d: int, tok: int, depth: int) -> _Pos | None:
    """From ``pos`` at depth ``d``, follow ``tok``; None when no occurrence continues so."""
    if type(pos) is _Node:
        return pos.children.get(tok)
    i = pos.start + d
    if d < depth and i < len(pos.seq) and pos.seq[i] == tok:
        return pos
    return None


def _has_next(pos: _Pos, d: int, depth: int) -> bool:
    """Some occurrence of ``pos``'s string (depth ``d``) is followed by a token."""
    if type(pos) is _Node:
        return pos.total > 0
    return d < depth and pos.start + d < len(pos.seq)


def _draft(pos: _Pos, d: int, max_len: int, min_prob: float,
           depth: int) -> tuple[list[int], float]:
    """Greedy most-frequent-child path from ``pos`` (depth ``d``): the draft and its score,
    the sum of its tokens' cumulative probabilities. Stops before a token whose cumulative
    probability would be below ``min_prob``."""
    draft: list[int] = []
    cum = 1.0
    score = 0.0
    while len(draft) < max_len:
        if type(pos) is _Node:
            if not pos.total:
                break
            tok = _best(pos)
            child = pos.children[tok]
            cum *= child.count / pos.total
            if cum < min_prob:
                break
            pos = child
        else:
            i = pos.start + d
            if d >= depth or i >= len(pos.seq):
                break
            tok = pos.seq[i]  # probability 1: one occurrence
        draft.append(tok)
        score += cum
        d += 1
    return draft, score


class _Request:
    """One running request: its context, its own trie and its match in the global trie."""

    __slots__ = ("active", "gen", "glen", "gpos", "prompt_len", "tokens", "trie")

    def __init__(self, depth: int, global_root: _Node, prompt_len: int = 0) -> None:
        self.tokens: list[int] = []
        self.prompt_len = prompt_len  # its first tokens that are the prompt
        self.trie = SuffixTrie(depth)
        self.active: list[_Node] = [self.trie.root]
        # Invariant (while gen == the proposer's generation): gpos is the global position of
        # the longest suffix of tokens, at most max_depth long, that occurs in the global
        # trie followed by some token; glen is its length.
        self.gpos: _Pos = global_root
        self.glen = 0
        self.gen = -1


class SuffixProposer:
    """SuffixDecoding drafts from the request's own context and from finished requests.

    ``max_depth`` bounds the matched suffix; the tries keep windows of ``max_depth +
    num_speculative_tokens`` tokens so a full-length match still has a full draft after it.
    A draft token's probability is its child count over the node's ``total`` (occurrences
    of the matched string that are followed by a token).
    """

    name = "suffix"
    # Finished tokens inserted into the global tree per proposal, at most, per draft it
    # asks for: a lone probe (one request's drafts after a stretch without any) pays a
    # few hundred inserts, not the whole stretch's backlog (thousands at batch 16, which
    # priced every later draft out); drafting steadily, the backlog stays near empty.
    FLUSH_TOKENS_PER_DRAFT = 256
    # ... and per step (``propose_batch``), whatever the drafts asked: inserts cost ~4 us
    # a token on code text, and a probe's 16 drafts would otherwise pay 4,096 of them
    # (16 ms, five steps at batch 16). Drafting at batch 64, requests end at ~128 tokens
    # a step: the backlog still drains.
    FLUSH_TOKENS_PER_STEP = 512

    def __init__(self, num_speculative_tokens: int, *, max_depth: int = 32,
                 max_cached_requests: int = 1000, min_token_prob: float = 0.1,
                 max_spec_factor: float = 1.0, min_match: int = 1) -> None:
        if num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        if max_depth < 1:
            raise ValueError("max_depth must be >= 1")
        if max_cached_requests < 0:
            raise ValueError("max_cached_requests must be >= 0")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError("min_token_prob must be in [0, 1]")
        if max_spec_factor < 0:
            raise ValueError("max_spec_factor must be >= 0")
        if min_match < 0:
            raise ValueError("min_match must be >= 0")
        self.num_speculative_tokens = num_speculative_tokens
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.min_token_prob = min_token_prob
        self.max_spec_factor = max_spec_factor
        self.min_match = min_match
        self._depth = max_depth + max(1, num_speculative_tokens)  # trie window
        self._global = SuffixTrie(self._depth)
        self._cached: deque[list[int]] = deque()  # FIFO of finished sequences in _global
        self._cached_tokens = 0
        # Finished sequences not in _global yet (oldest first). A request's end only queues
        # its tokens; the next proposal inserts them (a bounded amount per call), so the
        # tree's upkeep is paid inside the time the runner measures as proposing (the
        # draft-length controller prices it) and not at all while nobody proposes.
        self._pending: deque[list[int]] = deque()
        self._gen = 0  # bumped at every change of _global: invalidates requests' matches
        self._requests: dict[str, _Request] = {}

    # -- the engine's calls -------------------------------------------------------------

    def propose_batch(self, items: Sequence) -> dict[str, list[int]]:
        """One step's proposals (``ProposeItem``s): the global tree's upkeep once, within
        the step's budget, then each request's drafts."""
        asked = sum(min(it.k, self.num_speculative_tokens) for it in items if it.k > 0)
        if self._pending and asked:
            self._flush(min(self.FLUSH_TOKENS_PER_DRAFT * asked, self.FLUSH_TOKENS_PER_STEP))
        out = {}
        for it in items:
            drafts = self.propose(it.req_id, it.token_ids, it.k, flush=False,
                                  num_prompt_tokens=it.num_prompt_tokens)
            if drafts:
                out[it.req_id] = drafts
        return out

    def propose(self, req_id: str, token_ids: Sequence[int], k: int,
                flush: bool = True, num_prompt_tokens: int = 0) -> list[int]:
        """Up to min(k, num_speculative_tokens) draft tokens continuing token_ids (prompt +
        output so far); ``flush``: pay some of the global tree's upkeep first. The first
        ``num_prompt_tokens`` are the prompt: its own trie holds them, the global trie
        only what follows (0: all of them go there too)."""
        if flush and self._pending and k > 0:
            self._flush(self.FLUSH_TOKENS_PER_DRAFT * min(k, self.num_speculative_tokens))
        st = self._requests.get(req_id)
        n = len(token_ids)
        if st is not None:
            seen = st.tokens
            m = len(seen)
            # Not an extension of what was seen (preemption, recomputed outputs): rebuild.
            if n < m or (m and (token_ids[m - 1] != seen[m - 1] or token_ids[0] != seen[0])):
                st = None
        if st is None:
            st = self._requests[req_id] = _Request(self._depth, self._global.root,
                                                   num_prompt_tokens)
        start = len(st.tokens)
        toks = st.tokens
        if n > start:
            toks.extend(token_ids[start:])
            trie = st.trie
            active = st.active
            for pos in range(start, n):
                active = trie.extend(active, toks, pos)
            st.active = active
        if st.gen != self._gen:
            self._global_rematch(st)
        else:
            for pos in range(start, n):
                self._global_step(st, pos)

        limit = min(k, self.num_speculative_tokens)
        if limit <= 0:
            return []
        best: list[int] = []
        best_score = 0.0
        # Own trie: the explicit active nodes are the suffixes seen before (so followed by
        # a token); the longest of them, capped at max_depth, is the match.
        m = min(len(st.active) - 1, self.max_depth)
        while m > 0 and not st.active[m].total:
            m -= 1
        if m >= self.min_match:
            best, best_score = _draft(st.active[m], m, self._cap(m, limit),
                                      self.min_token_prob, self._depth)
        if st.glen >= self.min_match:
            d, s = _draft(st.gpos, st.glen, self._cap(st.glen, limit),
                          self.min_token_prob, self._depth)
            if s > best_score:  # ties: the request's own draft
                best = d
        return best

    def finish(self, req_id: str) -> None:
        """The request ended: drop its own tree and queue its outputs for the global tree
        (SuffixDecoding's "previous outputs": other requests' prompts are other texts,
        and inserting them would double the trees' upkeep). O(1) but for
        the outputs' copy: what a FIFO of ``max_cached_requests`` would evict unseen is
        dropped here."""
        st = self._requests.pop(req_id, None)
        if st is None or self.max_cached_requests == 0:
            return
        outputs = st.tokens[st.prompt_len:] if st.prompt_len else st.tokens
        self._pending.append(outputs)  # no longer appended to: the trie may reference it
        while len(self._pending) > self.max_cached_requests:
            self._pending.popleft()  # would be inserted, then evicted before any lookup

    def _flush(self, max_tokens: int | None = None) -> None:
        """Insert queued sequences, oldest first, until ``max_tokens`` were inserted (one
        sequence at least; all if None), evicting FIFO beyond ``max_cached_requests``.
        The lookups see exactly the FIFO once the queue is empty."""
        done = 0
        cached, pending = self._cached, self._pending
        # Cached sequences the queue will push out anyway go first: no insert is wasted.
        while cached and len(cached) + len(pending) > self.max_cached_requests:
            old = cached.popleft()
            self._global.remove(old)
            self._cached_tokens -= len(old)
        while pending and (max_tokens is None or done < max_tokens):
            seq = pending.popleft()
            self._global.insert(seq)
            cached.append(seq)
            self._cached_tokens += len(seq)
            done += len(seq) + 1
            while len(cached) > self.max_cached_requests:
                old = cached.popleft()
                self._global.remove(old)
                self._cached_tokens -= len(old)
        self._gen += 1

    def stats(self) -> dict:
        """The trees' sizes once the queue of finished requests is in (introspection)."""
        if self._pending:
            self._flush()
        return {
            "global_nodes": self._global.num_nodes,
            "global_leaves": self._global.num_leaves,
            "global_size": len(self._global),
            "cached_requests": len(self._cached),
            "cached_tokens": self._cached_tokens,
            "active_requests": len(self._requests),
        }

    # -- internals ----------------------------------------------------------------------

    def _cap(self, match_len: int, limit: int) -> int:
        """Draft length allowed by a match of ``match_len`` tokens."""
        return min(limit, int(self.max_spec_factor * match_len + 1e-9))

    def _global_step(self, st: _Request, pos: int) -> None:
        """Keep st's global match after appending tokens[pos]. The strings of the global
        trie that are followed by a token form a factor-closed set, so the new match is an
        old match's suffix plus the token: amortized one walk of <= max_depth per token."""
        toks = st.tokens
        tok = toks[pos]
        depth = self._depth
        g, m = st.gpos, st.glen
        while True:
            if m < self.max_depth:
                nxt = _advance(g, m, tok, depth)
                if nxt is not None and _has_next(nxt, m + 1, depth):
                    g, m = nxt, m + 1
                    break
            if m == 0:
                g = self._global.root
                break
            m -= 1
            w = self._global.walk(toks, pos - m, pos)
            assert w is not None  # a suffix of a match is a match
            g = w
        st.gpos, st.glen = g, m

    def _global_rematch(self, st: _Request) -> None:
        """Find st's global match from scratch (the global trie changed): binary search on
        the length, valid since a match's suffixes are matches. O(max_depth log max_depth)."""
        toks = st.tokens
        n = len(toks)
        depth = self._depth
        lo, hi = 0, min(self.max_depth, n)
        g: _Pos = self._global.root
        while lo < hi:
            mid = (lo + hi + 1) // 2
            w = self._global.walk(toks, n - mid, n)
            if w is not None and _has_next(w, mid, depth):
                lo, g = mid, w
            else:
                hi = mid - 1
        st.gpos, st.glen, st.gen = g, lo, self._gen
