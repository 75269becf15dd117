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
    collective for a peer that is gone. The same thread posts a sign of life (a counter under `ALIVE_KEY`)
    every `POLL_S`.
A process that dies without posting (killed, its host lost) breaks the collectives its peers are in: a peer that
raises then looks for silent processes (no sign of life for `SILENCE_S`), prints `stopping: process P is gone
(...)`, or, when the coordination service cannot be reached, `stopping: process 0 (the coordinator at ADDRESS) is
gone (...)`, and exits 1. JAX's coordination client also hears of the loss, of the coordinator at once and of
another process after `heartbeat_timeout_s` (a peer stuck waiting): it then aborts the process with "Terminating
process because the JAX distributed service detected fatal errors" (jaxlib's handler: the client's callback
takes an absl::Status that Python cannot receive). Whichever comes first ends the process.
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
ALIVE_KEY = "specache_jax/alive/"
EXITING = "exiting"            # a process's last sign of life: it is leaving (failed or done), not lost
POLL_S = 0.25
SILENCE_S = 1.0                # a peer whose sign of life does not change for this long is gone
ACK_WAIT_S = 5.0               # a failing process waits this long for the others to read its error
EXIT_GRACE_S = 1.5             # process 0 (the coordination service) outlives a failed peer by this much

_at_exit = weakref.WeakSet()   # objects whose close() runs before jax.distributed.shutdown
_stop = threading.Event()
_watcher: threading.Thread | None = None
_address = ""                  # the coordinator's HOST:PORT (messages)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
               shutdown_timeout_s: int = SHUTDOWN_TIMEOUT_S, initialization_timeout_s: int = 120) -> None:
  """Join the processes (call before any jax op). Unset arguments come from $JAX_COORDINATOR_ADDRESS /
  $JAX_NUM_PROCESSES / $JAX_PROCESS_ID (read by jax) or a cluster jax detects (TPU slices, SLURM, ...)."""
  global _watcher, _address
  for name, value in (("num_processes", num_processes), ("process_id", process_id)):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
      raise ValueError(f"{name}={value!r} must be an integer >= 0")
  if num_processes is not None and process_id is not None and process_id >= num_processes:
    raise ValueError(f"process_id={process_id} must be < num_processes={num_processes}")
  jax.distributed.initialize(coordinator_address, num_processes, process_id,
                             initialization_timeout=initialization_timeout_s,
                             heartbeat_timeout_seconds=heartbeat_timeout_s,
                             shutdown_timeout_seconds=shutdown_timeout_s)
  from jax._src import distributed
  _address = distributed.global_state.coordinator_address or ""
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


def _coordinator() -> str:
  return f"process 0 (the coordinator at {_address})"


def _silent_peers(client, me: int, n: int) -> list[int] | None:
  """The other processes whose sign of life stays unchanged for SILENCE_S (and who are not leaving): killed, or
  their host lost. None: the coordination service cannot be reached (process 0, which hosts it, is gone)."""
  try:
    first = dict(client.key_value_dir_get(ALIVE_KEY))
    time.sleep(SILENCE_S)
    last = dict(client.key_value_dir_get(ALIVE_KEY))
  except Exception:                         # noqa: BLE001 (the service is unreachable)
    return None
  keys = {p: ALIVE_KEY + str(p) for p in range(n) if p != me}
  return [p for p, k in keys.items() if last.get(k) != EXITING and last.get(k) == first.get(k)]


def _fail(previous_hook, exc_type, exc, tb) -> None:
  """An uncaught exception: report it as usual, name the processes that are gone (when that is the cause), post
  it for the other processes, exit 1 (no barrier)."""
  previous_hook(exc_type, exc, tb)
  _stop_watcher()
  client, me, n = _client(), jax.process_index(), jax.process_count()
  error = "".join(traceback.format_exception_only(exc_type, exc)).strip()
  silent = _silent_peers(client, me, n) if n > 1 else []
  if silent is None:
    print(f"stopping: {_coordinator()} is gone (killed, or its host unreachable)", file=sys.stderr, flush=True)
    _exit(1)
  if silent:
    gone = (f"process {silent[0]} is gone" if len(silent) == 1 else
            f"processes {', '.join(map(str, silent))} are gone")
    print(f"stopping: {gone} (no sign of life for {SILENCE_S:g} s: killed, or its host unreachable)",
          file=sys.stderr, flush=True)
    error += f" ({gone})"
  try:
    client.key_value_set(FAILED_KEY, f"process {me} failed: {error}")
    deadline = time.monotonic() + ACK_WAIT_S
    while time.monotonic() < deadline and len(client.key_value_dir_get(ACK_KEY)) < n - 1 - len(silent):
      time.sleep(POLL_S)
  except Exception:                         # noqa: BLE001 (the service may be gone: exit anyway)
    pass
  _exit(1)


def _watch() -> None:
  """Post a sign of life and poll for a peer's failure; on one, say which process failed and why, and exit 1.
  Stopped, post EXITING."""
  client, alive, beat = _client(), ALIVE_KEY + str(jax.process_index()), 0
  while not _stop.wait(POLL_S):
    beat += 1
    try:
      client.key_value_set(alive, str(beat), allow_overwrite=True)
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
  try:
    client.key_value_set(alive, EXITING, allow_overwrite=True)
  except Exception:                         # noqa: BLE001 (the service is gone)
    pass
