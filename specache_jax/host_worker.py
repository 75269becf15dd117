"""The host store's worker thread, the fetches queued on it, and what a fault of either raises.

A fetch of the numpy host store (offload.NumpyHostStore) is a job on one worker thread; the runtime waits on it
a step later. `PendingFetch.result()` turns what can go wrong there into errors that name the layer group:
the job raised (or a write queued before it did) -> HostStoreError with the worker's exception as its cause;
the rows are not ready within the store's fetch_timeout_s -> HostFetchTimeout. Either stops the generation at
that wait: it never hangs and never attends to rows the store failed to write.
"""
from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
import math
import weakref

from specache_jax.errors import ConfigError

FETCH_TIMEOUT_ENV = "SPECACHE_JAX_FETCH_TIMEOUT_S"
FETCH_TIMEOUT_DEFAULT_S = 60.0


class HostStoreError(RuntimeError):
  """The host store's worker failed a fetch of the named layer group (the worker's exception is the cause)."""


class HostFetchTimeout(HostStoreError, TimeoutError):
  """A fetch whose rows were not ready within the store's fetch_timeout_s (a stalled or starved worker)."""


def resolve_fetch_timeout(seconds: float | None = None) -> float:
  """`seconds`, else $SPECACHE_JAX_FETCH_TIMEOUT_S, else 60: how long a wait on one fetch may take."""
  raw = os.environ.get(FETCH_TIMEOUT_ENV, "") if seconds is None else seconds
  try:
    value = float(raw) if raw != "" else FETCH_TIMEOUT_DEFAULT_S
  except (TypeError, ValueError):
    value = float("nan")
  if not (value > 0 and math.isfinite(value)):
    src = f"{FETCH_TIMEOUT_ENV}={raw!r}" if seconds is None else f"fetch_timeout_s={seconds!r}"
    raise ConfigError(f"{src} must be a finite number of seconds > 0")
  return value


class Worker:
  """One daemon thread running submitted jobs in FIFO order -> concurrent.futures.Future (what a
  ThreadPoolExecutor(max_workers=1) gives, except that the interpreter does not join the thread at exit: a job
  stalled for good cannot hang the process after its fetch timed out). The thread ends when the worker is
  shut down or garbage-collected."""

  def __init__(self, name: str):
    self._jobs, self._abandoned = queue.SimpleQueue(), threading.Event()
    self._thread = threading.Thread(target=_work, args=(self._jobs, self._abandoned), name=name, daemon=True)
    self._thread.start()
    weakref.finalize(self, self._jobs.put, None)

  def submit(self, fn) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    self._jobs.put((future, fn))
    return future

  def abandon(self) -> None:
    """After a stall: jobs still queued are cancelled, and shutdown no longer waits for the thread."""
    self._abandoned.set()

  def shutdown(self) -> None:
    self._jobs.put(None)
    if not self._abandoned.is_set():
      self._thread.join()


def _work(jobs: queue.SimpleQueue, abandoned: threading.Event) -> None:
  while (item := jobs.get()) is not None:
    future, fn = item
    del item
    if abandoned.is_set():
      future.cancel()
    elif future.set_running_or_notify_cancel():
      try:
        future.set_result(fn())
      except BaseException as e:       # noqa: BLE001 (delivered to whoever waits on the fetch)
        future.set_exception(e)
    del future, fn                      # hold no block while idle


class PendingFetch:
  """A fetch queued on the host worker; `result()` waits for its rows, as `concurrent.futures.Future.result`.

  A job that raised -> HostStoreError naming the layer group, the worker's exception chained as its cause; not
  ready within `timeout_s` -> HostFetchTimeout (and the worker is abandoned: nothing queued after it runs)."""

  def __init__(self, future: concurrent.futures.Future, layers: tuple[int, ...], timeout_s: float, worker=None):
    self._future, self.layers, self.timeout_s, self._worker = future, layers, timeout_s, worker

  def done(self) -> bool:
    return self._future.done()

  def result(self):
    what = f"the host KV store's fetch of layers {list(self.layers)}" if self.layers else "the host KV store"
    try:
      return self._future.result(timeout=self.timeout_s)
    except concurrent.futures.TimeoutError:
      if self._future.done():            # the job itself raised a TimeoutError
        raise HostStoreError(f"{what} failed in the worker: {self._future.exception()!r}") \
            from self._future.exception()
      if self._worker is not None:
        self._worker.abandon()
      raise HostFetchTimeout(
          f"{what} was not ready after fetch_timeout_s={self.timeout_s:g} s: the store's worker thread is "
          f"stalled (or starved of CPU); a slow host may raise ${FETCH_TIMEOUT_ENV}") from None
    except concurrent.futures.CancelledError:
      raise HostStoreError(f"{what} was cancelled: an earlier fetch of this store timed out") from None
    except Exception as e:               # noqa: BLE001 (the worker's exception, named and chained)
      cause = str(e) if isinstance(e, HostStoreError) else f"{type(e).__name__}: {e}"
      raise HostStoreError(f"{what} failed in the worker: {cause}") from e
