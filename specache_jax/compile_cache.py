"""JAX's persistent compilation cache for the library's programs: compiled once, kept across processes.

`configure()` runs once, when `specache_jax` is imported (every launcher imports it). Import time, not first use:
JAX reads the cache folder at a process's first compilation and keeps what it found for the process, so a folder
set after a user's own first `jax.jit` would still apply, but one set after the library's first program would
not — and the library cannot see its first program coming (an eager `jnp` op compiles too).

  SPECACHE_JAX_COMPILE_CACHE unset   the folder `default_dir()`: `$XDG_CACHE_HOME/specache_jax/xla`, or
                                     `~/.cache/specache_jax/xla`
  SPECACHE_JAX_COMPILE_CACHE=<dir>   that folder
  SPECACHE_JAX_COMPILE_CACHE=0       off (JAX's own settings apply: none, unless the user set one)

A cache folder the user already gave JAX (`JAX_COMPILATION_CACHE_DIR`, or `jax.config.update(
"jax_compilation_cache_dir", ...)` before the import) is left as it is, with JAX's other cache settings.

Every program is written, however fast it compiled (`jax_persistent_cache_min_compile_time_secs=0`, unless the
environment sets it): the first `generate` of a process compiles many programs, most of them small, and reading
one back is faster than compiling it (results/compile_cache_cpu.md). JAX's own size limit
(`jax_compilation_cache_max_size`) scans the whole folder under a lock on every write, quadratic in the entries, so
the limit is kept here instead, once per process: a folder past `max_bytes` loses its least recently written
entries down to half of it.

Entries are keyed by the program, its compile options, the XLA flags and the jax/jaxlib versions, so a stale
entry is never a wrong one, only an unused one (the compile options hold the folder's own path, for XLA's GPU
autotuning cache beside it: a folder copied or moved elsewhere starts cold). An entry that cannot be read back
(truncated, bit-flipped: the stored executables are zlib streams with a checksum) is not loaded: JAX warns ("Error
reading persistent compilation cache entry for '<program>'") and compiles the program as if the entry were
missing. JAX never overwrites an entry, so a damaged one warns in every process until it is removed (delete the
folder: it is only a cache). The folder is trusted (JAX loads machine code from it): do not share it with users
you do not trust.
"""
from __future__ import annotations

import os
from pathlib import Path

import jax

ENV = "SPECACHE_JAX_COMPILE_CACHE"
MAX_BYTES = 2 << 30          # a folder past this is trimmed to half when a process configures the cache
_ENTRY_SUFFIX = "-cache"     # JAX's file cache: <key>-cache (the executable), <key>-atime (its LRU stamp)

_status: str | None = None


def default_dir() -> Path:
  """`$XDG_CACHE_HOME/specache_jax/xla`, or `~/.cache/specache_jax/xla` when XDG_CACHE_HOME is unset or empty."""
  base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
  return Path(base) / "specache_jax" / "xla"


def trim(folder: Path, max_bytes: int = MAX_BYTES) -> int:
  """Removes the least recently written entries of a cache folder holding more than `max_bytes`, down to half
  of it -> the bytes removed (0 when under the limit or unreadable). Safe beside running processes: an entry
  removed under a reader is a cache miss, one read half-removed falls back to compiling."""
  entries = []
  try:
    with os.scandir(folder) as it:
      for e in it:
        if e.name.endswith(_ENTRY_SUFFIX) and e.is_file(follow_symlinks=False):
          st = e.stat(follow_symlinks=False)
          entries.append((st.st_mtime, st.st_size, e.path))
  except OSError:
    return 0
  total = sum(size for _, size, _ in entries)
  if total <= max_bytes:
    return 0
  removed = 0
  for _, size, path in sorted(entries):
    if total - removed <= max_bytes // 2:
      break
    for p in (path, path[:-len(_ENTRY_SUFFIX)] + "-atime"):
      try:
        os.unlink(p)
      except OSError:
        pass
    removed += size
  return removed


def configure(max_bytes: int = MAX_BYTES) -> str:
  """Turns JAX's persistent compilation cache on for this process as the module docstring says (idempotent: the
  first call decides) -> `status()`."""
  global _status
  if _status is not None:
    return _status
  setting = os.environ.get(ENV, "")
  user_dir = jax.config.jax_compilation_cache_dir
  if setting == "0":
    _status = f"off ({ENV}=0)" + (f"; JAX's own folder {user_dir}" if user_dir else "")
  elif user_dir:
    _status = f"left to JAX (jax_compilation_cache_dir={user_dir})"
  else:
    folder = Path(setting).expanduser() if setting else default_dir()
    try:
      folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:                   # a read-only home: compile as JAX does without a cache
      _status = f"off (cannot create {folder}: {e})"
      return _status
    trim(folder, max_bytes)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    for name, value in (("jax_persistent_cache_min_compile_time_secs", 0.0),
                        ("jax_persistent_cache_min_entry_size_bytes", -1)):     # -1: every entry, whatever its size
      if name.upper() not in os.environ:                                       # the user's own value stays
        jax.config.update(name, value)
    _status = f"on ({folder})"
  return _status


def status() -> str:
  """'on (<folder>)', 'off (...)' or 'left to JAX (...)' (configures the cache if nothing did yet)."""
  return configure()
