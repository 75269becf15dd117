"""Flags every launcher shares (multi-host start-up, the device mesh) and the body of the sweep launchers
(the benchmark launchers' is `bench/launch.py`).

  --distributed      join JAX's multi-process runtime before anything else touches JAX (specache_jax.multiprocess:
                     bounded heartbeats, a clean exit, a failing process stops the others): one launcher per
                     process, with --coordinator_address=HOST:PORT --num_processes=N --process_id=I, or
                     $JAX_COORDINATOR_ADDRESS / $JAX_NUM_PROCESSES / $JAX_PROCESS_ID, or a cluster jax detects
                     (TPU slices, SLURM). The mesh spans every process's devices; every process runs every cell
                     and only process 0 writes the output folder.
  --mesh=DATA,MODEL  run generation on a ("data", "model") mesh: batch rows on data, attention/KV heads and the
                     MLP hidden dim on model (specache_jax.sharding); empty = one device
"""
from __future__ import annotations

import contextlib
import logging as py_logging
import os
import pathlib
import shlex
import shutil
import sys
import tempfile

import jax
from absl import app, flags, logging

from experiments.lib import store
from specache_jax import sharding
from specache_jax.checkpoints import CheckpointError
from specache_jax.errors import ConfigError
from specache_jax.offload import MemoryPlanError

_DISTRIBUTED = flags.DEFINE_bool("distributed", False,
                                 "multi-process: join JAX's distributed runtime before any JAX work")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "--distributed: process 0's HOST:PORT (default $JAX_COORDINATOR_ADDRESS)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None,
                                      "--distributed: how many processes (default $JAX_NUM_PROCESSES)")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "--distributed: this process's id, 0 .. num_processes - 1 "
                                   "(default $JAX_PROCESS_ID)")
_MESH = flags.DEFINE_string("mesh", "", "'DATA,MODEL' mesh axis sizes (e.g. 2,4); empty: a single device")


def parse_mesh(text: str):
  """'' -> None; 'D,M' -> sharding.make_mesh(D, M) over the visible devices (all hosts' after --distributed)."""
  text = (text or "").strip()
  if not text:
    return None
  parts = [p.strip() for p in text.split(",")]
  if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
    raise ValueError(f"--mesh={text!r} must be 'DATA,MODEL', two integers >= 1 (e.g. --mesh=2,4)")
  return sharding.make_mesh(int(parts[0]), int(parts[1]))


class _QuietLibraries:
  """A logging filter: orbax's per-load INFO lines (throughput, metadata stores) stay out of the launchers' log."""

  def filter(self, record) -> bool:
    return record.levelno >= 30 or "/orbax/" not in record.pathname.replace("\\", "/")


def start(argv):
  """Call first in a launcher's main(): rejects stray arguments, initializes multi-host JAX if asked, quiets
  orbax's INFO lines, returns the mesh (or None)."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  py_logging.getLogger("absl").addFilter(_QuietLibraries())
  given = {k: f.value for k, f in (("coordinator_address", _COORDINATOR), ("num_processes", _NUM_PROCESSES),
                                   ("process_id", _PROCESS_ID)) if f.value is not None}
  if given and not _DISTRIBUTED.value:
    raise app.UsageError(f"--{', --'.join(given)} need(s) --distributed")
  try:
    sharding.maybe_initialize_distributed(_DISTRIBUTED.value, **given)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  try:
    return parse_mesh(_MESH.value)
  except ValueError as e:                 # a bad flag value: absl's usage error, not a traceback
    raise app.UsageError(str(e)) from None


def user_errors() -> tuple[type, ...]:
  """Exceptions that mean bad input (a config value, a checkpoint, a memory plan): a usage message, no traceback."""
  return (ConfigError, CheckpointError, MemoryPlanError)


@contextlib.contextmanager
def bad_input_as_usage(*extra: type):
  """Inside: a user_errors() (or `extra`) exception becomes absl's usage message naming it."""
  try:
    yield
  except (*user_errors(), *extra) as e:
    raise app.UsageError(f"{type(e).__name__}: {e}") from None


def start_one_device(name: str, argv) -> None:
  """`start` for a launcher that runs on one device: a --mesh is a usage error."""
  if start(argv) is not None:
    raise app.UsageError(f"--mesh={_MESH.value!r}: experiments.{name} runs on one device; drop --mesh")


def command_line(name: str) -> str:
  """The command that reproduces this run of `experiments.<name>` (recorded with its results)."""
  return shlex.join(["python", "-m", f"experiments.{name}"] + sys.argv[1:])


def run_sweep(name: str, config, runner, argv, *, mesh_ok: bool, unit: str = "cell(s)") -> None:
  """The body of every sweep launcher: flags -> (distributed, mesh) -> runner(config, ...) -> printed table."""
  mesh = start(argv)
  if mesh is not None and not mesh_ok:
    raise app.UsageError(f"--mesh={_MESH.value!r}: experiments.{name} runs on one device (teacher forcing and "
                         "the hit-rate probes are not sharded); drop --mesh")
  logging.info("config:\n%s", config)
  logging.info("devices: %s; mesh: %s", jax.devices(), mesh)
  kwargs = {"mesh": mesh} if mesh_ok else {}
  with bad_input_as_usage(), _process_zero_writes(config) as writes:
    result = runner(config, command=command_line(name), log=logging.info, **kwargs)
  if writes:
    print(result.table)
    print(f"\n{result.computed} {unit} computed, {result.skipped} reused, {result.seconds:.0f} s; "
          f"written to {config.output_dir}/")


COPY_PREFIX = "specache_sweep_copy_"     # + pid: a process's private copy of the output folder, in $TMPDIR


def _remove_dead_copies() -> None:
  """Remove the private copies that processes of this host killed mid-sweep left behind."""
  for folder in pathlib.Path(tempfile.gettempdir()).glob(COPY_PREFIX + "*"):
    pid = folder.name[len(COPY_PREFIX):].split("_", 1)[0]
    if pid.isdigit() and not store.process_alive(int(pid)):
      shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _process_zero_writes(config):
  """Several processes: process 0 writes config.output_dir; every other one runs on a private copy of it (so
  each process decides alike which cells a resumed sweep reuses), removed at the end (or, when the process is
  killed, by the next sweep on this host). Yields whether this process writes the real folder."""
  if jax.process_count() == 1:
    yield True
    return
  from jax.experimental import multihost_utils
  real = config.output_dir
  _remove_dead_copies()
  with tempfile.TemporaryDirectory(prefix=f"{COPY_PREFIX}{os.getpid()}_") as tmp:
    if jax.process_index() != 0:
      copy = os.path.join(tmp, "out")
      if os.path.isdir(real):
        shutil.copytree(real, copy)
      config.output_dir = copy
    multihost_utils.sync_global_devices("output folder read")    # before process 0 writes anything
    try:
      yield jax.process_index() == 0
    finally:
      config.output_dir = real
