"""The library's persistent compilation cache (specache_jax.compile_cache): where it goes, what turns it off or
leaves it to the user, that a warm folder compiles nothing, and that damaged entries fall back to compiling.

Each case is a fresh process: JAX reads the cache settings once per process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from specache_jax import compile_cache

ROOT = Path(__file__).resolve().parents[1]

# A fresh process: imports the library (which configures the cache), then the tiny model's first generate, counting
# JAX's compile events during the call.
_CHILD = r"""
import json, sys, warnings
import jax, numpy as np
import specache_jax as sj
from specache_jax import compile_cache
sys.path.insert(0, "tests")
from tiny import tiny_model
events = {"programs": 0, "read_back": 0}
def on_event(name, **_):
  if name == "/jax/compilation_cache/cache_hits":
    events["read_back"] += 1
def on_duration(name, secs, **_):
  if name == "/jax/core/compile/backend_compile_duration":
    events["programs"] += 1
jax.monitoring.register_event_listener(on_event)
jax.monitoring.register_event_duration_secs_listener(on_duration)
lm = tiny_model(seed=3)
prompt = np.random.RandomState(0).randint(0, lm.config.vocab_size, size=(1, 40)).astype(np.int32)
before = dict(events)
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  tokens = np.asarray(sj.generate(lm, prompt, max_new_tokens=5, cache="full").tokens)
print(json.dumps(dict(status=compile_cache.status(), tokens=tokens.tolist(),
                      programs=events["programs"] - before["programs"],
                      read_back=events["read_back"] - before["read_back"],
                      cache_dir=jax.config.jax_compilation_cache_dir,
                      cache_warnings=sum("persistent compilation cache" in str(w.message) for w in caught))))
"""


def _run(env_updates: dict, code: str = _CHILD) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "SPECACHE_JAX_COMPILE_CACHE")}
  env.update(env_updates)
  done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


def _entries(folder: Path) -> list[Path]:
  return sorted(folder.glob("*-cache"))


def test_default_dir_follows_xdg_cache_home(monkeypatch, tmp_path):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert compile_cache.default_dir() == tmp_path / "specache_jax" / "xla"
  monkeypatch.setenv("XDG_CACHE_HOME", "")
  assert compile_cache.default_dir() == Path.home() / ".cache" / "specache_jax" / "xla"


def test_warm_folder_compiles_nothing_and_damaged_entries_recompile(tmp_path):
  folder = tmp_path / "xla"
  cold = _run({"SPECACHE_JAX_COMPILE_CACHE": str(folder)})
  assert cold["status"] == f"on ({folder})" and cold["cache_dir"] == str(folder)
  assert cold["programs"] > 0 and cold["read_back"] == 0
  entries = _entries(folder)
  assert entries, "the first process wrote no entry"

  warm = _run({"SPECACHE_JAX_COMPILE_CACHE": str(folder)})
  assert warm["tokens"] == cold["tokens"]
  assert warm["read_back"] == warm["programs"] == cold["programs"], warm       # every program read back

  pristine = {entry: entry.read_bytes() for entry in entries}
  for damage in ("truncated", "bit-flipped", "emptied"):      # in place: JAX's keys include the folder's path
    for entry, data in pristine.items():
      mid = len(data) // 2
      flipped = data[:mid] + bytes([data[mid] ^ 0x10]) + data[mid + 1:]
      entry.write_bytes({"truncated": data[:mid], "bit-flipped": flipped, "emptied": b""}[damage])
    damaged = _run({"SPECACHE_JAX_COMPILE_CACHE": str(folder)})
    assert damaged["tokens"] == cold["tokens"], damage
    assert damaged["read_back"] == 0 and damaged["programs"] == cold["programs"], (damage, damaged)
    assert damaged["cache_warnings"] == cold["programs"], (damage, damaged)       # one per damaged program
    for entry, data in pristine.items():
      entry.write_bytes(data)


_STATUS = r"""
import json, jax, jax.numpy as jnp
import specache_jax
from specache_jax import compile_cache
jax.jit(lambda x: x * 3)(jnp.ones(4)).block_until_ready()
print(json.dumps(dict(status=compile_cache.status(), cache_dir=jax.config.jax_compilation_cache_dir)))
"""


def test_off_default_and_user_folder(tmp_path):
  off = _run({"SPECACHE_JAX_COMPILE_CACHE": "0", "XDG_CACHE_HOME": str(tmp_path / "xdg")}, _STATUS)
  assert off["status"].startswith("off") and off["cache_dir"] is None
  assert not (tmp_path / "xdg").exists()

  default = _run({"XDG_CACHE_HOME": str(tmp_path / "xdg")}, _STATUS)
  assert default["cache_dir"] == str(tmp_path / "xdg" / "specache_jax" / "xla")
  assert _entries(tmp_path / "xdg" / "specache_jax" / "xla")

  user = _run({"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "mine"), "SPECACHE_JAX_COMPILE_CACHE": str(tmp_path / "x"),
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}, _STATUS)
  assert user["status"].startswith("left to JAX") and user["cache_dir"] == str(tmp_path / "mine")
  assert not (tmp_path / "x").exists() and _entries(tmp_path / "mine")


def test_trim_removes_the_oldest_entries_down_to_half(tmp_path):
  for i in range(10):
    entry = tmp_path / f"k{i}-cache"
    entry.write_bytes(b"x" * 100)
    (tmp_path / f"k{i}-atime").write_bytes(b"t")
    os.utime(entry, (1000 + i, 1000 + i))
  (tmp_path / "unrelated.txt").write_bytes(b"y" * 5000)
  assert compile_cache.trim(tmp_path, max_bytes=2000) == 0                 # 1000 bytes of entries: under the limit
  assert compile_cache.trim(tmp_path, max_bytes=800) == 600                # down to 400: the 6 oldest go
  assert [p.name for p in _entries(tmp_path)] == [f"k{i}-cache" for i in range(6, 10)]
  assert sorted(p.name for p in tmp_path.glob("*-atime")) == [f"k{i}-atime" for i in range(6, 10)]
  assert (tmp_path / "unrelated.txt").exists()
