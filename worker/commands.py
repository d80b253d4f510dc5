"""The engine thread's command queue, and how it keeps serving commands while a step runs.

`CommandQueue` holds the commands asyncio code queued for the engine thread (`EngineService`).
`serve_while_waiting` is the engine's `StepPipeline.step_waiter`: it hands the step's CUDA event
to a waiter thread and runs commands as they come until that thread says the event has passed,
so a command waits for the engine thread's host work, not for the device's step.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

Command = Callable[[], None]


class CommandQueue:
    """Commands for the engine thread, and the waiter thread that watches its steps. `start()`
    the waiter before the first step; `stop_waiter()` ends it."""

    def __init__(self) -> None:
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._steps: queue.SimpleQueue[Any] = queue.SimpleQueue()  # CUDA events; None: stop
        self._waiter = threading.Thread(target=self._wait_for_steps, name="engine-waiter",
                                        daemon=True)  # fmt: skip
        self._wait_error: BaseException | None = None

    def start(self) -> None:
        self._waiter.start()

    def stop_waiter(self) -> None:
        self._steps.put(None)

    def put(self, command: Command) -> None:
        self._commands.put(command)

    def get(self, timeout_s: float) -> Command:
        """The next command; raises queue.Empty after `timeout_s`."""
        return self._commands.get(timeout=timeout_s)

    def run_queued(self) -> None:
        """Run every command queued by now (on the engine thread)."""
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                return

    def serve_while_waiting(self, done: Any) -> None:
        """The engine's `step_waiter`: run commands as they come until the step's event `done`
        has passed (the waiter thread's `_step_done` says so). On the CPU (`done` is None) the
        step has already run: the commands queued by now run, so that the CPU's tests take the
        path a GPU takes."""
        if done is None:
            self.run_queued()
            return
        self._steps.put(done)
        while (command := self._commands.get()) is not _step_done:
            command()
        error, self._wait_error = self._wait_error, None
        if error is not None:
            raise error  # the step failed: the engine thread fails its requests
        done.synchronize()  # has passed: a no-op that makes sure, whatever the queue held

    def _wait_for_steps(self) -> None:
        """The waiter thread: wait for each step event it is given, then wake the engine
        thread with `_step_done` (also when the wait failed, with the error kept for it)."""
        while (done := self._steps.get()) is not None:
            try:
                done.synchronize()
            except BaseException as err:  # raised again on the engine thread
                self._wait_error = err
            self._commands.put(_step_done)


def _step_done() -> None:
    """The waiter thread's word that the step the engine thread waits for has finished (a
    command that does nothing, should one ever be run as a command)."""
