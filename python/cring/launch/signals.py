# Signal handling of cringrun: records the signals the launcher forwards,
# wakes the main loop on them and on SIGCHLD, and blocks them in helper
# threads. Sends no signal itself (the job does).
"""Signals received by cringrun."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

# Only used when main() runs outside the main thread, where signal handlers
# (and so SIGCHLD wake-ups) cannot be installed.
_POLL_INTERVAL_WITHOUT_SIGNALS_S = 0.05

# Signals the launcher forwards to the ranks (each one, received, also sets
# the launcher's exit status to 128 + signum).
FORWARDED_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class SignalWatcher:
    """Records SIGINT/SIGTERM/SIGHUP and wakes the main loop on those and SIGCHLD.

    Uses signal.set_wakeup_fd so that a signal arriving at any moment makes the
    next wait() return at once; no wake-up is lost and nothing polls. Signals
    that were ignored when the launcher started (nohup, background jobs) stay
    ignored. Outside the main thread no handler can be installed; wait() then
    returns after a short interval so exits are still noticed.
    """

    def __init__(self) -> None:
        self._pending: list[int] = []
        self._previous_handlers: dict[int, Any] = {}
        self._previous_wakeup_fd = -1
        self._wake_read = -1
        self._wake_write = -1
        self._selector: selectors.BaseSelector | None = None
        self.active = False

    def __enter__(self) -> SignalWatcher:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._wake_write, warn_on_full_buffer=False)
        self.active = True
        for signum in FORWARDED_SIGNALS:
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN:
                continue
            self._previous_handlers[signum] = previous
            signal.signal(signum, self._record)
        # A Python-level handler makes the C handler write to the wakeup fd.
        self._previous_handlers[signal.SIGCHLD] = signal.getsignal(signal.SIGCHLD)
        signal.signal(signal.SIGCHLD, self._ignore)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self.active:
            return
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        assert self._selector is not None
        self._selector.close()
        os.close(self._wake_read)
        os.close(self._wake_write)
        self.active = False

    def _record(self, signum: int, frame: object) -> None:
        self._pending.append(signum)

    def _ignore(self, signum: int, frame: object) -> None:
        pass

    def wake(self) -> None:
        """Make wait() return now (callable from any thread)."""
        if not self.active:
            return
        try:
            os.write(self._wake_write, b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending (or the watcher is closing)

    def take_signals(self) -> list[int]:
        taken, self._pending = self._pending, []
        return taken

    def wait(self, timeout_s: float | None) -> None:
        """Block until a signal arrives or timeout_s passes (None: no limit)."""
        if not self.active:
            time.sleep(
                _POLL_INTERVAL_WITHOUT_SIGNALS_S
                if timeout_s is None
                else min(timeout_s, _POLL_INTERVAL_WITHOUT_SIGNALS_S)
            )
            return
        assert self._selector is not None
        self._selector.select(timeout_s)
        try:
            while os.read(self._wake_read, 256):
                pass
        except BlockingIOError:
            pass


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    """Block the launcher's signals in this thread for the duration.

    Threads created meanwhile (the output thread, the store's C thread) inherit
    the blocked mask, so every signal is delivered to the main thread and never
    interrupts a system call in theirs.
    """
    watched = {*FORWARDED_SIGNALS, signal.SIGCHLD}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
