"""The CPU kernels' native build: one shared library per sources, jaxlib, compiler, flags and CPU.

  python -m specache_jax.cpu_kernels      # builds (or finds) the library for this CPU (__main__.py); setup.sh runs it

The library goes to a cache folder (`$SPECACHE_JAX_KERNEL_CACHE`, default `~/.cache/specache_jax/kernels`) under a
key of the sources and headers, the jaxlib version, the compiler (path and version), the flags, and the CPU: its
model name (/proc/cpuinfo) and the target the compiler resolves the architecture flags to on it (its predefined
macros under those flags: `__AVX512F__`, `__AVX2__`, `__znver3__`, ...). A home folder shared between hosts (a
cluster's NFS home) therefore holds one library per kind of CPU, and no host loads another's.

Beside each library a manifest (`.json`) records what it was built for and its SHA-256. A library is loaded only
when its manifest matches this host's key, its bytes match the recorded hash, and this CPU has every vector
extension the build targeted (`/proc/cpuinfo` flags against the `__AVX*__`/`__FMA__` macros: a library that
would stop on an illegal instruction is refused, with a status naming the missing extensions); anything else —
missing, truncated, altered, or built elsewhere — is rebuilt. `SPECACHE_JAX_KERNEL_ARCH` replaces the
architecture flags (default `-march=native`; e.g. `-march=x86-64-v3` for one library that every AVX2 host can
load, or `-march=native -mno-avx512f` to build the kernels' AVX2 paths on an AVX-512 host, as a test does).
The build turns warnings on (`-Wall`; the jaxlib headers are included as system headers) and the sources compile
without any, with AVX-512 and without; the compiler's output is kept in the manifest.
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

SOURCES = tuple(Path(__file__).with_name(n) for n in ("skinny_matmul.cc", "mixed_attention.cc", "select.cc",
                                                          "prefill_attention.cc", "dense_attention.cc",
                                                          "ring_keys.cc"))
HEADERS = tuple(Path(__file__).with_name(n) for n in ("common.h", "mixed_values.h"))
# -Wno-psabi: GCC's note that 64-byte vector arguments pass differently without AVX-512 (an ABI of GCC 4.6); every
# function taking one is inline in the library, compiled with the same flags.
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-Wall", "-Wno-psabi")
ARCH_ENV = "SPECACHE_JAX_KERNEL_ARCH"
DEFAULT_ARCH = ("-march=native",)
_VECTOR_MACRO = re.compile(r"#define __((?:AVX|FMA)[A-Z0-9_]*)__ 1$")


def cache_dir() -> Path:
  return Path(os.environ.get("SPECACHE_JAX_KERNEL_CACHE", Path.home() / ".cache" / "specache_jax" / "kernels"))


def compiler() -> str | None:
  return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def arch_flags() -> tuple[str, ...]:
  """The architecture flags: `$SPECACHE_JAX_KERNEL_ARCH` split like a shell would, default `-march=native`."""
  text = os.environ.get(ARCH_ENV, "").strip()
  return tuple(shlex.split(text)) if text else DEFAULT_ARCH


def _cpuinfo() -> dict[str, str]:
  """The first processor's fields of /proc/cpuinfo ({} where there is none: not Linux)."""
  try:
    text = Path("/proc/cpuinfo").read_text()
  except OSError:
    return {}
  fields = {}
  for line in text.split("\n\n")[0].splitlines():
    name, _, value = line.partition(":")
    fields.setdefault(name.strip(), value.strip())
  return fields


def cpu_model() -> str:
  info = _cpuinfo()
  return (info.get("model name") or info.get("Model") or info.get("Hardware") or info.get("CPU part")
          or f"unknown {os.uname().machine}")


def cpu_flags() -> frozenset[str] | None:
  """The CPU's extension flags from /proc/cpuinfo (x86: `flags`, ARM: `Features`), None where unknown."""
  info = _cpuinfo()
  text = info.get("flags", info.get("Features"))
  return None if text is None else frozenset(text.split())


@dataclasses.dataclass(frozen=True)
class Target:
  """What a build targets on this host: the CPU, the compiler, the flags and what they resolve to."""
  cpu: str                      # /proc/cpuinfo's model name
  compiler: str                 # path and first line of `--version`
  flags: tuple[str, ...]        # FLAGS + the architecture flags
  macros_sha256: str            # of the compiler's predefined macros under the architecture flags
  vector_extensions: tuple[str, ...]   # the __AVX*__ / __FMA*__ macros among them, lower case ("avx2", ...)

  def key(self, texts: list[str]) -> str:
    parts = [*texts, jaxlib.__version__, self.cpu, self.compiler, *self.flags, self.macros_sha256]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]

  def missing_extensions(self) -> list[str]:
    """The targeted vector extensions this CPU's /proc/cpuinfo flags lack ([] where the flags are unknown)."""
    flags = cpu_flags()
    if flags is None:
      return []
    have = {f.replace("_", "") for f in flags}
    return [e for e in self.vector_extensions if e.replace("_", "") not in have]


def target(cxx: str, arch: tuple[str, ...]) -> Target:
  """This host's Target for `cxx` and the architecture flags `arch` (asks the compiler for its predefined macros).

  Raises RuntimeError naming the command when the compiler cannot answer (a missing or broken compiler)."""
  cmd = [cxx, *arch, "-x", "c++", "-E", "-dM", "-"]
  try:
    done = subprocess.run(cmd, input="", capture_output=True, text=True)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
  except OSError as e:
    raise RuntimeError(f"compiling the CPU kernels failed ({' '.join(cmd)}): {e}") from None
  if done.returncode != 0:
    raise RuntimeError(f"compiling the CPU kernels failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
  macros = sorted(done.stdout.splitlines())
  vector = tuple(sorted(m.group(1).lower() for line in macros if (m := _VECTOR_MACRO.match(line))))
  return Target(cpu=cpu_model(), compiler=" ".join([cxx, *version]), flags=FLAGS + tuple(arch),
                macros_sha256=hashlib.sha256("\n".join(macros).encode()).hexdigest(), vector_extensions=vector)


def _sha256(path: Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()


def manifest_path(lib: Path) -> Path:
  return lib.with_suffix(".json")


def _valid(lib: Path, want: dict) -> bool:
  """Whether `lib` and its manifest are a finished build for `want` (the manifest's fields but the hash and the
  compiler output), its bytes unaltered."""
  try:
    got = json.loads(manifest_path(lib).read_text())
    return ({k: got.get(k) for k in want} == want and got.get("sha256") == _sha256(lib))
  except (OSError, ValueError):
    return False


def build(out_dir: Path | None = None, arch: tuple[str, ...] | None = None) -> Path:
  """The library for this host -> its path: the cached one where valid (module docstring), else compiled now.

  out_dir: default `cache_dir()`; arch: default `arch_flags()`. Raises RuntimeError naming the compiler command and
  its output when compiling fails, and naming the extensions this CPU lacks when the target needs them."""
  cxx = compiler()
  if cxx is None:
    raise RuntimeError("no C++ compiler found (looked for $CXX, g++, c++, clang++)")
  tgt = target(cxx, arch_flags() if arch is None else tuple(arch))
  missing = tgt.missing_extensions()
  if missing:
    raise RuntimeError(f"the kernels' target {' '.join(tgt.flags[len(FLAGS):])} needs {', '.join(missing)}, "
                       f"which this CPU ({tgt.cpu}) does not list in /proc/cpuinfo")
  texts = [f.read_text() for f in SOURCES + HEADERS]
  out_dir = cache_dir() if out_dir is None else Path(out_dir)
  lib = out_dir / f"specache_cpu_kernels-{tgt.key(texts)}.so"
  want = {"jaxlib": jaxlib.__version__, **dataclasses.asdict(tgt)}
  want["flags"], want["vector_extensions"] = list(tgt.flags), list(tgt.vector_extensions)   # as JSON reads them
  if lib.exists() and _valid(lib, want):
    return lib
  out_dir.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=out_dir) as tmp:          # build aside, then rename: atomic for racers
    tmp_lib = Path(tmp) / lib.name
    cmd = [cxx, *tgt.flags, "-isystem", jax.ffi.include_dir(), *map(str, SOURCES), "-o", str(tmp_lib)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
      raise RuntimeError(f"compiling the CPU kernels failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
    tmp_manifest = manifest_path(tmp_lib)
    tmp_manifest.write_text(json.dumps({**want, "sha256": _sha256(tmp_lib), "command": cmd,
                                        "compiler_output": done.stdout + done.stderr}, indent=1))
    os.replace(tmp_manifest, manifest_path(lib))                 # a reader between the two renames sees a hash
    os.replace(tmp_lib, lib)                                     # mismatch and builds its own: never a wrong load
  return lib


def discard(lib: Path) -> None:
  """Removes a library and its manifest, so that the next `build` compiles it again."""
  for p in (lib, manifest_path(lib)):
    try:
      p.unlink()
    except OSError:
      pass


def load(out_dir: Path | None = None, arch: tuple[str, ...] | None = None) -> tuple[ctypes.CDLL, Path]:
  """`build` then load -> (the library's handle, its path). One that is valid by its manifest yet fails to load
  (OSError: a damaged file, a missing symbol) is discarded and built again, once; the second failure raises."""
  lib = build(out_dir, arch)
  try:
    return ctypes.cdll.LoadLibrary(str(lib)), lib
  except OSError:
    discard(lib)
    lib = build(out_dir, arch)
    return ctypes.cdll.LoadLibrary(str(lib)), lib
