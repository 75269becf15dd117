"""One stage of the device check, recorded as it runs (`experiments/lib/bench/gpu_check.py` uses it).

OUTDIR/<stage>.json is written when the stage starts (status "running") and rewritten after every check, so a
stage that dies keeps what it finished. Each check runs in its own try: an exception is recorded (error and
traceback) and the next check runs. A stage has a deadline inside Python, below the shell's `timeout`:
- at the deadline SIGALRM raises `Deadline` in the main thread; the check that was running is recorded as
  interrupted, the remaining ones as not run, and the JSON gets status "deadline";
- SIGINT (the shell's `timeout --signal=INT`) raises KeyboardInterrupt and SIGTERM raises `Killed`: both are
  recorded the same way, with status "killed (SIGINT)" / "killed (SIGTERM)";
- a main thread stuck in native code (a compile, a device wait) does not see a signal until it returns, so a
  watchdog thread writes the JSON with status "deadline" a few seconds after the deadline and ends the process.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import traceback

EXIT_FAILED = 1          # a check failed (the others ran)
EXIT_INTERRUPTED = 124   # the deadline or a signal stopped the stage (as `timeout` reports a limit)
WATCHDOG_GRACE_S = 5.0


class Deadline(BaseException):
  """The stage's own time limit passed (raised in the main thread by SIGALRM)."""


class Killed(BaseException):
  """SIGTERM reached the stage."""


def _interruption(e: BaseException) -> str:
  if isinstance(e, Deadline):
    return "deadline"
  if isinstance(e, KeyboardInterrupt):
    return "killed (SIGINT)"
  if isinstance(e, Killed):
    return "killed (SIGTERM)"
  return f"killed ({type(e).__name__})"


def _ok(value) -> bool:
  if isinstance(value, bool):
    return value
  if isinstance(value, dict):
    return bool(value.get("ok", True))
  return True


class StageRecord:
  """OUTDIR/<stage>.json for one stage: `check(name, fn)` runs and records one check; `run(body)` runs the stage
  body under the deadline and returns the exit code (0 ok, 1 a check failed, 124 deadline or signal)."""

  def __init__(self, out_dir: str, stage: str, header: dict, deadline_s: float | None = None):
    os.makedirs(out_dir, exist_ok=True)
    self.path = os.path.join(out_dir, f"{stage}.json")
    self.deadline_s = deadline_s
    self.payload = dict(header, stage=stage, status="running", deadline_s=deadline_s, checks={}, current=None)
    self._lock = threading.Lock()
    self._t0 = time.perf_counter()
    self._done = False
    self._expired = False       # set by the alarm: its Deadline can be swallowed (a gc callback, a __del__)
    self.write()

  def _raise_if_expired(self) -> None:
    """The deadline as an exception where the alarm's own was swallowed."""
    if self._expired:
      raise Deadline(f"{self.deadline_s} s")

  def write(self) -> None:
    """Rewrites the JSON (atomically: a reader never sees half a file)."""
    with self._lock:
      self.payload["seconds"] = round(time.perf_counter() - self._t0, 3)
      tmp = f"{self.path}.tmp{os.getpid()}"
      with open(tmp, "w") as f:
        json.dump(self.payload, f, indent=1, default=str)
      os.replace(tmp, self.path)

  def check(self, name: str, fn, *args, **kwargs):
    """fn(*args, **kwargs) -> its value, recorded under checks[name] with ok (a bool value is the verdict, a dict
    its "ok" key, anything else ok) and seconds; an exception is recorded and returns None; a BaseException
    (deadline, SIGINT, SIGTERM) is recorded and re-raised: the stage stops."""
    self._raise_if_expired()
    self.payload["current"] = name
    self.write()
    rec: dict = {}
    t0 = time.perf_counter()
    value = None
    try:
      value = fn(*args, **kwargs)
      self._raise_if_expired()                          # the deadline passed during fn, its alarm swallowed
      rec.update(ok=_ok(value), value=value)
    except Exception as e:
      rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-4000:])
    except BaseException as e:
      rec.update(ok=False, error=f"interrupted: {_interruption(e)}", traceback=traceback.format_exc()[-2000:])
      raise
    finally:
      rec["seconds"] = round(time.perf_counter() - t0, 3)
      self.payload["checks"][name] = rec
      self.payload["current"] = None
      self.write()
    return value

  def remaining(self) -> float | None:
    """Seconds left before the deadline (None: no deadline)."""
    return None if not self.deadline_s else self.deadline_s - (time.perf_counter() - self._t0)

  def skip(self, name: str, reason: str) -> None:
    """A check that does not apply here: recorded as skipped (not a failure)."""
    self.payload["checks"][name] = dict(ok=True, skipped=reason, seconds=0.0)
    self.write()

  def _watchdog(self) -> None:
    if self._done:
      return
    with self._lock:
      current = self.payload.get("current")
    if current:
      self.payload["checks"][current] = dict(ok=False, error="interrupted: deadline (stuck in native code)")
    self.payload.update(status="deadline", error=f"the main thread was still busy {WATCHDOG_GRACE_S} s after the "
                        f"deadline ({self.deadline_s} s), in check {current!r}; the watchdog ended the process")
    self.write()
    print(json.dumps({k: self.payload[k] for k in ("stage", "status", "seconds")}), flush=True)
    os._exit(EXIT_INTERRUPTED)

  def run(self, body) -> int:
    """body(self) under the deadline; the final status is written whatever happens. Returns the exit code."""
    def on_alarm(signum, frame):
      self._expired = True
      raise Deadline(f"{self.deadline_s} s")

    def on_term(signum, frame):
      raise Killed("SIGTERM")

    old = {s: signal.getsignal(s) for s in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = None
    if self.deadline_s:
      signal.signal(signal.SIGALRM, on_alarm)
      signal.setitimer(signal.ITIMER_REAL, self.deadline_s)
      timer = threading.Timer(self.deadline_s + WATCHDOG_GRACE_S, self._watchdog)
      timer.daemon = True
      timer.start()
    code = 0
    try:
      try:
        body(self)
        self._raise_if_expired()
        failed = sorted(k for k, v in self.payload["checks"].items() if not v.get("ok"))
        self.payload["status"] = "failed checks" if failed else "ok"
        if failed:
          self.payload["failed"] = failed
          code = EXIT_FAILED
      finally:
        signal.setitimer(signal.ITIMER_REAL, 0)         # no alarm while the status is written
    except Exception as e:                              # the stage's own code, outside any check
      self.payload.update(status="error", error=f"{type(e).__name__}: {e}"[:2000],
                          traceback=traceback.format_exc()[-4000:])
      code = EXIT_FAILED
    except BaseException as e:                          # deadline or signal: what finished is kept
      self.payload.update(status=_interruption(e), error=f"stopped: {_interruption(e)}")
      code = EXIT_INTERRUPTED
    finally:
      self._done = True
      if timer is not None:
        timer.cancel()
      for s, h in old.items():
        signal.signal(s, h)
      self.write()
    print(json.dumps({k: self.payload[k] for k in ("stage", "status", "seconds")}), flush=True)
    return code
