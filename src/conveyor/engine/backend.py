"""The contract between the front end (``AsyncEngine``) and what runs its engine core: a
thread in this process (``async_engine.ThreadBackend``) or a process of its own
(``core_process.ProcessBackend``). Both backends and the front end import it; it imports
neither of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from conveyor.config import EngineConfig
from conveyor.engine.engine_loop import LoopCommand, LoopMessage


@dataclass
class EngineInfo:
    """What the front end needs to know of the engine without reaching into it."""

    config: EngineConfig
    tokenizer: Any  # the front end's tokenizer (None: token ids only)

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len


class EngineSink(Protocol):
    """The front end's side of a backend; called from the backend's threads."""

    def messages(self, messages: list[LoopMessage]) -> None: ...
    def died(self, error: BaseException | None) -> None: ...


class CoreBackend(Protocol):
    info: EngineInfo
    accepts_local_calls: bool

    def start(self, sink: EngineSink) -> None: ...
    def send(self, cmd: LoopCommand) -> None: ...
    def join(self, timeout_s: float) -> None: ...
    def close(self) -> None: ...
