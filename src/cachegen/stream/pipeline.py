"""How the loader's two stages are scheduled: threads in real time, events in virtual time.

A stage is a generator that yields operations instead of doing what may block:
:class:`Call` (blocking work: a store fetch through the link, a decode, a
recompute), :class:`Send` (hand a message to the other stage; waits while
``capacity`` messages wait), :class:`Receive` (the next message, or ``None``
once the clock passes ``until``) and :class:`StopProducer`. A :class:`Runner`
drives a *producer* stage (the fetches) and a *consumer* stage (decode, stitch).
The stage code (planning, fault handling, stitching) is the same for both runners:

* :class:`ThreadedRunner` runs the producer in a thread and the consumer in the
  calling thread, so chunk ``i + 1`` is on the wire while chunk ``i`` decodes. The
  consumer never waits past ``until``; a producer stuck in a stalled store call
  is abandoned (it stops at its next operation), never waited for.
* :class:`VirtualRunner` steps both stages in the calling thread in order of a
  :class:`VirtualClock` (the next event first, ties in arrival order), so a load
  is replayed deterministically with no sleeping: the link and the compute work
  advance the clock by what they would have taken.

An exception raised by a :class:`Call` is thrown into the stage at its ``yield``,
so stages handle faults with ordinary ``try``/``except``. When the producer
ends (returns or raises), the runner delivers :class:`ProducerEnded`.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from cachegen.errors import LoaderError
from cachegen.stream.protocols import Clock

R = TypeVar("R")


@dataclass(frozen=True)
class Call:
    """Blocking work done by the stage itself; the stage receives ``fn()`` (or its exception)."""

    fn: Callable[[], Any]


@dataclass(frozen=True)
class Send:
    """Hand ``msg`` to the consumer; blocks while ``capacity`` messages wait."""

    msg: Any


@dataclass(frozen=True)
class Receive:
    """The next message, or ``None`` once the clock reads ``until`` (``math.inf``: wait for it)."""

    until: float = math.inf


@dataclass(frozen=True)
class StopProducer:
    """The consumer needs no more messages: the producer is stopped (or abandoned mid-call)."""


@dataclass(frozen=True)
class ProducerEnded:
    """Delivered after the producer's last message; ``error`` is what it raised (None: it returned)."""

    error: BaseException | None = None


Op = Call | Send | Receive | StopProducer
Stage = Generator[Op, Any, R]


class Runner(Protocol):
    def run(self, producer: Stage[Any], consumer: Stage[R], capacity: int) -> R:
        """Drive both stages to the consumer's end and return its value."""
        ...


# -- real time ------------------------------------------------------------------------


class _Channel:
    """A bounded FIFO between the threads whose waits end at a deadline or when stopped."""

    def __init__(self, capacity: int, clock: Clock):
        self.capacity, self.clock = capacity, clock
        self._items: deque[Any] = deque()
        self._cond = threading.Condition()
        self.stopped = False

    def put(self, msg: Any, force: bool = False) -> bool:
        with self._cond:
            while not force and len(self._items) >= self.capacity and not self.stopped:
                self._cond.wait()
            if self.stopped:
                return False
            self._items.append(msg)
            self._cond.notify_all()
            return True

    def get(self, until: float) -> Any:
        with self._cond:
            while not self._items:
                if math.isinf(until):
                    self._cond.wait()
                    continue
                left = until - self.clock()
                if left <= 0:
                    return None
                self._cond.wait(left)
            msg = self._items.popleft()
            self._cond.notify_all()
            return msg

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._items.clear()
            self._cond.notify_all()


class ThreadedRunner:
    """The producer in a daemon thread, the consumer in the calling thread (real time)."""

    def __init__(self, clock: Clock = time.perf_counter, thread_name: str = "cachegen-fetch"):
        self.clock, self.thread_name = clock, thread_name

    def run(self, producer: Stage[Any], consumer: Stage[R], capacity: int) -> R:
        ch = _Channel(capacity, self.clock)
        th = threading.Thread(target=self._produce, args=(producer, ch), name=self.thread_name, daemon=True)
        th.start()
        try:
            return self._consume(consumer, ch)
        finally:
            ch.stop()  # not joined: a thread blocked in a stalled store call ends when the call returns
            consumer.close()

    @staticmethod
    def _produce(gen: Stage[Any], ch: _Channel) -> None:
        value: Any = None
        error: BaseException | None = None
        try:
            while not ch.stopped:
                op = gen.send(value) if error is None else gen.throw(error)
                value, error = None, None
                if isinstance(op, Call):
                    try:
                        value = op.fn()
                    except Exception as e:  # handed to the stage, which decides what a fault means
                        error = e
                elif isinstance(op, Send):
                    if not ch.put(op.msg):
                        return
                else:
                    raise LoaderError(f"a producer stage cannot {type(op).__name__}")
        except StopIteration:
            ch.put(ProducerEnded(), force=True)
        except BaseException as e:  # a bug in the stage: the consumer must hear of it, not hang
            ch.put(ProducerEnded(e), force=True)
        finally:
            gen.close()

    @staticmethod
    def _consume(gen: Stage[R], ch: _Channel) -> R:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                op = gen.send(value) if error is None else gen.throw(error)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            if isinstance(op, Call):
                try:
                    value = op.fn()
                except Exception as e:
                    error = e
            elif isinstance(op, Receive):
                value = ch.get(op.until)
            elif isinstance(op, StopProducer):
                ch.stop()
            else:
                raise LoaderError(f"a consumer stage cannot {type(op).__name__}")


# -- virtual time ---------------------------------------------------------------------


class VirtualClock:
    """A clock that moves only when told: ``sleep`` advances it (no real waiting)."""

    def __init__(self, start: float = 0.0):
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self.now += seconds


@dataclass
class _Proc(Generic[R]):
    gen: Stage[R]
    t: float = 0.0
    seq: int = 0  # when it became ready: ties at one time go in that order
    state: str = "ready"  # ready | send | recv | done
    value: Any = None
    error: BaseException | None = None
    pending: Any = None  # the message of a blocked Send
    until: float = math.inf  # the deadline of a blocked Receive


class VirtualRunner:
    """Both stages in the calling thread, one step at a time in order of virtual time.

    A :class:`Call` runs at once and its stage resumes when the clock has moved by
    what the work took (the link and the virtual codec ``sleep`` on the clock);
    whatever the other stage does in between happens in virtual-time order.
    Deterministic: the same inputs give the same event order."""

    def __init__(self, clock: VirtualClock):
        self.clock = clock
        self._seq = 0

    def _ready(self, p: _Proc[Any], t: float, value: Any = None, error: BaseException | None = None) -> None:
        self._seq += 1
        p.t, p.seq, p.state, p.value, p.error = t, self._seq, "ready", value, error

    def run(self, producer: Stage[Any], consumer: Stage[R], capacity: int) -> R:
        t0 = self.clock()
        prod: _Proc[Any] = _Proc(producer, t0)
        cons: _Proc[R] = _Proc(consumer, t0)
        self._ready(prod, t0)
        self._ready(cons, t0)
        queue: deque[Any] = deque()

        def deliver(msg: Any, t: float, force: bool = False) -> bool:
            """Queue ``msg`` sent at ``t``; False when the queue is full."""
            if not force and len(queue) >= capacity:
                return False
            queue.append(msg)
            if cons.state == "recv":
                self._ready(cons, t, queue.popleft())
            return True

        def end_producer(t: float, error: BaseException | None) -> None:
            prod.state = "done"
            deliver(ProducerEnded(error), t, force=True)

        try:
            while True:
                events: list[tuple[float, float, _Proc[Any]]] = []
                if prod.state == "ready":
                    events.append((prod.t, prod.seq, prod))
                if cons.state == "ready":
                    events.append((cons.t, cons.seq, cons))
                elif cons.state == "recv" and not math.isinf(cons.until):
                    events.append((max(cons.until, cons.t), math.inf, cons))  # the wait times out
                if not events:
                    raise LoaderError("virtual pipeline deadlock: the consumer waits for a message that never comes")
                t, _, p = min(events, key=lambda e: (e[0], e[1]))
                self.clock.now = t
                if p is cons and cons.state == "recv":
                    self._ready(cons, t, None)
                    continue
                try:
                    op = p.gen.send(p.value) if p.error is None else p.gen.throw(p.error)
                except StopIteration as stop:
                    if p is cons:
                        return stop.value
                    end_producer(t, None)
                    continue
                except Exception as e:
                    if p is cons:
                        raise
                    end_producer(t, e)
                    continue
                if isinstance(op, Call):
                    try:
                        value, error = op.fn(), None
                    except Exception as e:
                        value, error = None, e
                    self._ready(p, max(self.clock.now, t), value, error)
                elif isinstance(op, Send) and p is prod:
                    if deliver(op.msg, t):
                        self._ready(prod, t)
                    else:
                        prod.state, prod.pending = "send", op.msg
                elif isinstance(op, Receive) and p is cons:
                    if queue:
                        self._ready(cons, t, queue.popleft())
                        if prod.state == "send":  # a slot is free: the blocked send completes now
                            queue.append(prod.pending)
                            prod.pending = None
                            self._ready(prod, t)
                    elif op.until <= t:
                        self._ready(cons, t, None)
                    else:
                        cons.state, cons.until, cons.t = "recv", op.until, t
                elif isinstance(op, StopProducer) and p is cons:
                    if prod.state != "done":
                        prod.gen.close()
                        prod.state = "done"
                    queue.clear()
                    self._ready(cons, t)
                else:
                    raise LoaderError(f"a {'consumer' if p is cons else 'producer'} stage cannot {type(op).__name__}")
        finally:
            producer.close()
            consumer.close()
