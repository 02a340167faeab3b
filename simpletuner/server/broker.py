"""Wakes SSE streams when events are stored. Events themselves are always read from the database, so a
stream that missed a wake-up (or an event stored by another server sharing the database) still sees them
at its next poll."""

from __future__ import annotations

import asyncio
import threading


class Subscription:
    def __init__(self, broker: "EventBroker") -> None:
        self._broker = broker
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()

    def clear(self) -> None:
        """Call before reading the database, so a notify that lands during the read is not lost."""
        self._event.clear()

    async def wait(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def _wake(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._event.set)
        except RuntimeError:  # loop closed
            pass

    async def __aenter__(self) -> "Subscription":
        with self._broker._lock:
            self._broker._subs.add(self)
        return self

    async def __aexit__(self, *exc) -> None:
        with self._broker._lock:
            self._broker._subs.discard(self)


class EventBroker:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subs: set[Subscription] = set()

    def subscribe(self) -> Subscription:
        return Subscription(self)

    def notify(self) -> None:
        """Wake every subscribed stream; safe to call from any thread."""
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            sub._wake()

    @property
    def subscribers(self) -> int:
        return len(self._subs)
