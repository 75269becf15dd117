"""JAX's multi-process runtime, bounded: start, a clean exit, and a failure that stops every process.

`initialize` joins the processes (`jax.distributed.initialize` with heartbeat and shutdown limits) and installs
  - at exit, `shutdown`: every live object `close_at_shutdown` registered (the mesh host stores: their worker
    threads hold device arrays) is closed, then `jax.distributed.shutdown()` (a barrier of all processes);
  - for an uncaught exception, `_fail`: the traceback as usual, then the error is posted to the coordination
    service's key-value store and the process exits with status 1 without the shutdown barrier (which the
    others, still computing, would never reach: both would abort when it timed out);
  - a watcher thread that polls that key: a process whose peer failed prints `stopping: process P failed:
    <error>`, acknowledges it and exits with status 1 (process 0, which hosts the coordination service, a moment
    after the failed process: a process whose service vanishes is aborted by JAX), instead of waiting in a
    collective for a peer that is gone.
A process that dies without posting (killed) is noticed by the coordination service after `heartbeat_timeout_s`;
JAX then terminates the others with "the JAX distributed service detected fatal errors" (an abort, bounded).
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
import weakref

import jax

HEARTBEAT_TIMEOUT_S = 30       # a process silent this long is dead: the others are stopped
SHUTDOWN_TIMEOUT_S = 30        # the wait at exit for every process to reach the shutdown barrier
FAILED_KEY = "specache_jax/failed"
ACK_KEY = "specache_jax/failed_ack/"
POLL_S = 0.25
ACK_WAIT_S = 5.0               # a failing process waits this long for the others to read its error
EXIT_GRACE_S = 1.5             # process 0 (the coordination service) outlives a failed peer by this much

_at_exit = weakref.WeakSet()   # objects whose close() runs before jax.distributed.shutdown
_stop = threading.Event()
_watcher: threading.Thread | None = None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
               shutdown_timeout_s: int = SHUTDOWN_TIMEOUT_S, initialization_timeout_s: int = 120) -> None:
  """Join the processes (call before any jax op). Unset arguments come from $JAX_COORDINATOR_ADDRESS /
  $JAX_NUM_PROCESSES / $JAX_PROCESS_ID (read by jax) or a cluster jax detects (TPU slices, SLURM, ...)."""
  global _watcher
  for name, value in (("num_processes", num_processes), ("process_id", process_id)):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
      raise ValueError(f"{name}={value!r} must be an integer >= 0")
  if num_processes is not None and process_id is not None and process_id >= num_processes:
    raise ValueError(f"process_id={process_id} must be < num_processes={num_processes}")
  jax.distributed.initialize(coordinator_address, num_processes, process_id,
                             initialization_timeout=initialization_timeout_s,
                             heartbeat_timeout_seconds=heartbeat_timeout_s,
                             shutdown_timeout_seconds=shutdown_timeout_s)
  atexit.register(shutdown)
  previous = sys.excepthook
  sys.excepthook = lambda *exc: _fail(previous, *exc)
  _stop.clear()
  _watcher = threading.Thread(target=_watch, name="distributed-failure-watch", daemon=True)
  _watcher.start()


def close_at_shutdown(obj) -> None:
  """Run `obj.close()` at `shutdown` if obj is still alive then (a host store: it stops the store's worker)."""
  _at_exit.add(obj)


def _client():
  from jax._src import distributed
  return distributed.global_state.client


def _stop_watcher() -> None:
  _stop.set()
  if _watcher is not None and _watcher is not threading.current_thread():
    _watcher.join()


def shutdown() -> None:
  """Close what `close_at_shutdown` registered and is alive, then `jax.distributed.shutdown()`."""
  _stop_watcher()
  for obj in list(_at_exit):
    try:
      obj.close()
    except Exception:                       # noqa: BLE001 (a failing close must not skip the shutdown)
      pass
  _at_exit.clear()
  jax.distributed.shutdown()


def _exit(code: int) -> None:
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def _fail(previous_hook, exc_type, exc, tb) -> None:
  """An uncaught exception: report it as usual, post it for the other processes, exit 1 (no barrier)."""
  previous_hook(exc_type, exc, tb)
  _stop_watcher()
  client, me, n = _client(), jax.process_index(), jax.process_count()
  message = f"process {me} failed: {''.join(traceback.format_exception_only(exc_type, exc)).strip()}"
  try:
    client.key_value_set(FAILED_KEY, message)
    deadline = time.monotonic() + ACK_WAIT_S
    while time.monotonic() < deadline and len(client.key_value_dir_get(ACK_KEY)) < n - 1:
      time.sleep(POLL_S)
  except Exception:                         # noqa: BLE001 (the service may be gone: exit anyway)
    pass
  _exit(1)


def _watch() -> None:
  """Poll for a peer's failure; on one, say which process failed and why, and exit 1."""
  client = _client()
  while not _stop.wait(POLL_S):
    try:
      message = client.key_value_try_get(FAILED_KEY)
    except Exception:                       # noqa: BLE001 (not posted: the usual case)
      continue
    print(f"stopping: {message}", file=sys.stderr, flush=True)
    try:
      client.key_value_set(ACK_KEY + str(jax.process_index()), "1")
    except Exception:                       # noqa: BLE001
      pass
    if jax.process_index() == 0:            # it hosts the coordination service: the failed process leaves first
      time.sleep(EXIT_GRACE_S)
    _exit(1)
