"""Queue structures the policies share: FIFO with push-front, and a lazy-deletion heap.

A simulator drives the scheduler with tens of thousands of waiting requests, so
no operation here is linear in the queue length:

    FifoQueue   append / push_front / remove / first      O(1)
    LazyHeap    push (or re-key) / peek / pop             O(log n) amortised
                remove                                    O(1) (the entry dies in place)
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Any, Generic, TypeVar

from conveyor.request import Request

T = TypeVar("T")


class FifoQueue:
    """Requests in queue order; a preempted request can be put back at the front."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, Request] = OrderedDict()

    def append(self, request: Request) -> None:
        self._items[request.request_id] = request

    def push_front(self, request: Request) -> None:
        self._items[request.request_id] = request
        self._items.move_to_end(request.request_id, last=False)

    def remove(self, request: Request) -> bool:
        return self._items.pop(request.request_id, None) is not None

    def first(self) -> Request | None:
        return next(iter(self._items.values()), None)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items.values())


class LazyHeap(Generic[T]):
    """Min-heap of items by a key, one live entry per id.

    Removing or re-keying an item leaves its old entry in the heap, dead; dead
    entries are dropped when they reach the top, and the heap is rebuilt when
    they outnumber the live ones (so memory stays proportional to live items).
    Ties on the key go to the item pushed first.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[Any, int, Hashable, T]] = []
        self._live: dict[Hashable, tuple[int, Any, T]] = {}
        self._seq = itertools.count()

    def push(self, item_id: Hashable, key: Any, item: T) -> None:
        """Insert, or replace the key of an item already present."""
        seq = next(self._seq)
        self._live[item_id] = (seq, key, item)
        heapq.heappush(self._heap, (key, seq, item_id, item))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [(k, s, i, it) for i, (s, k, it) in self._live.items()]
            heapq.heapify(self._heap)

    def remove(self, item_id: Hashable) -> bool:
        return self._live.pop(item_id, None) is not None

    def _drop_dead(self) -> None:
        heap, live = self._heap, self._live
        while heap:
            _, seq, item_id, _ = heap[0]
            entry = live.get(item_id)
            if entry is not None and entry[0] == seq:
                return
            heapq.heappop(heap)

    def peek(self) -> tuple[Any, T] | None:
        """(key, item) of the smallest live entry, or None."""
        self._drop_dead()
        if not self._heap:
            return None
        key, _, _, item = self._heap[0]
        return key, item

    def pop(self) -> tuple[Any, T] | None:
        top = self.peek()
        if top is not None:
            _, _, item_id, _ = heapq.heappop(self._heap)
            del self._live[item_id]
        return top

    def key_of(self, item_id: Hashable) -> Any:
        return self._live[item_id][1]

    def __contains__(self, item_id: Hashable) -> bool:
        return item_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[T]:
        return (item for _, _, item in self._live.values())
