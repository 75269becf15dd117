"""Where a generate call's time goes: wall time, time to first token, decode tokens/s, and the part spent
compiling, read from JAX's own monitoring events (no host sync inside a decoding step).

JAX records a time span for each stage of building a program (`jax.monitoring`; the names are jax's
`dispatch.JAXPR_TRACE_EVENT`, `JAXPR_TO_MLIR_MODULE_EVENT`, `BACKEND_COMPILE_EVENT`): tracing a function to a
jaxpr, lowering it to MLIR, and the backend compile (which also covers loading an executable from the persistent
compilation cache). `CompileLog` collects them while it is open; nested traces (a jitted function traced inside
another) overlap, so the seconds are those of the union of the spans, not their sum.
"""
from __future__ import annotations

import threading
import time

import jax
import numpy as np

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
COMPILE_EVENTS = {TRACE_EVENT: "trace", LOWER_EVENT: "lower", BACKEND_COMPILE_EVENT: "compile"}

_lock = threading.Lock()
_open_logs: list["CompileLog"] = []
_listening = False


def _on_span(event: str, start: float, end: float, **kwargs) -> None:
  kind = COMPILE_EVENTS.get(event)
  if kind is None:
    return
  with _lock:
    for log in _open_logs:
      log.spans.append((kind, start, end))


def _listen() -> None:
  """Register the one listener (once per process; it ignores events while no log is open)."""
  global _listening
  with _lock:
    if not _listening:
      jax.monitoring.register_event_time_span_listener(_on_span)
      _listening = True


def union_seconds(spans, since: float = -np.inf, until: float = np.inf) -> float:
  """Seconds covered by the union of (start, end) spans, clipped to [since, until]."""
  total, reach = 0.0, -np.inf
  for start, end in sorted((max(s, since), min(e, until)) for s, e in spans):
    if end <= start:
      continue
    total += max(0.0, end - max(start, reach))
    reach = max(reach, end)
  return total


class CompileLog:
  """A context manager that records JAX's trace / lower / backend-compile spans (time.time() seconds) made
  while it is open, on any thread."""

  def __init__(self):
    self.spans: list[tuple[str, float, float]] = []        # (kind: trace | lower | compile, start, end)

  def __enter__(self) -> "CompileLog":
    _listen()
    with _lock:
      _open_logs.append(self)
    return self

  def __exit__(self, *exc) -> None:
    with _lock:
      _open_logs.remove(self)

  def count(self, kind: str = "compile") -> int:
    """How many spans of one kind: "compile" counts the XLA executables built (or loaded from the persistent
    compilation cache), "trace" the functions traced."""
    return sum(k == kind for k, _, _ in self.spans)

  def seconds(self, since: float = -np.inf, until: float = np.inf) -> float:
    """Seconds spent tracing, lowering or compiling between `since` and `until`."""
    return union_seconds([(s, e) for _, s, e in self.spans], since, until)


class CallClock:
  """A context manager around a generate call: its start, the first token on the host (`first_token`, the one
  wait between the program that samples it and the decoding steps), its end (`stop`), and the compile spans
  made in between (`CompileLog`)."""

  def __init__(self):
    self.log = CompileLog()
    self.start = self.first = self.end = None

  def __enter__(self) -> "CallClock":
    self.log.__enter__()
    self.start = time.time()
    return self

  def __exit__(self, *exc) -> None:
    self.log.__exit__(*exc)

  def first_token(self, x) -> None:
    """Wait for x (an output of the program that samples the first token) and mark the time."""
    jax.block_until_ready(x)
    self.first = time.time()

  def stop(self, x) -> None:
    """Wait for x (the call's outputs) and mark the end."""
    jax.block_until_ready(x)
    self.end = time.time()

  def stats(self, new_tokens: int) -> dict:
    """The call's timing. new_tokens: tokens generated after the first one, summed over the rows.

      wall_s               the whole call
      ttft_s               start -> first token on the host (prefill, first sampling, SpeCache's pre-decoding
                           pass; with the compilation of their program when the call compiled it)
      decode_s             first token -> last
      decode_tokens_per_s  new_tokens / decode_s less the compile seconds inside it (the decoding rate)
      compile_s            seconds spent tracing, lowering and compiling (union of JAX's spans)
      compilations         XLA executables built or loaded from the persistent cache during the call"""
    decode_s = self.end - self.first
    decode_run = max(decode_s - self.log.seconds(self.first, self.end), 1e-9)
    return {"wall_s": self.end - self.start, "ttft_s": self.first - self.start, "decode_s": decode_s,
            "decode_tokens_per_s": new_tokens / decode_run, "compile_s": self.log.seconds(),
            "compilations": self.log.count("compile")}
