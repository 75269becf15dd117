"""The CPU kernels' native build (specache_jax.cpu_kernels.build): keyed by the CPU, never loading a library built
for another one or altered, warning-free, and correct with AVX-512 off.

The cache-policy tests build a one-function source (the real compiler, seconds); one test builds the real kernels
once more, without AVX-512, into a temporary folder and reruns their reference tests against that library."""
from __future__ import annotations

import ctypes
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from specache_jax import cpu_kernels as ck
from specache_jax.cpu_kernels import build as native

ROOT = Path(__file__).resolve().parents[1]
needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler")
x86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flags")
NO_AVX512 = ("-march=native", "-mno-avx512f")


@pytest.fixture
def small_source(tmp_path, monkeypatch):
  """The build's sources replaced by one exported function (what the cache policy sees is the same)."""
  src = tmp_path / "answer.cc"
  src.write_text('extern "C" int Answer() { return 42; }\n')
  monkeypatch.setattr(native, "SOURCES", (src,))
  monkeypatch.setattr(native, "HEADERS", ())
  return src


def _manifest(lib: Path) -> dict:
  return json.loads(native.manifest_path(lib).read_text())


def _built_for(lib: Path) -> dict:
  """What the manifest says a library was built for (not its hash, command line and compiler output)."""
  return {k: v for k, v in _manifest(lib).items() if k not in ("sha256", "command", "compiler_output")}


@needs_compiler
@x86
def test_target_and_key_follow_the_cpu_extensions():
  cxx = native.compiler()
  native_t, no512 = native.target(cxx, ("-march=native",)), native.target(cxx, NO_AVX512)
  assert native_t.cpu == no512.cpu == native.cpu_model() != ""
  assert "avx512f" not in no512.vector_extensions
  assert native_t.missing_extensions() == [] == no512.missing_extensions()      # this CPU runs both
  if "avx512f" in (native.cpu_flags() or ()):
    assert "avx512f" in native_t.vector_extensions
    assert native_t.key(["src"]) != no512.key(["src"])
  assert native_t.key(["src"]) != native_t.key(["src changed"])


@needs_compiler
def test_built_library_is_reused_and_rebuilt_when_built_elsewhere_or_altered(small_source, tmp_path):
  out = tmp_path / "kernels"
  lib = native.build(out)
  manifest = _built_for(lib)
  assert manifest["cpu"] == native.cpu_model() and "-Wall" in manifest["flags"]
  assert ctypes.CDLL(str(lib)).Answer() == 42
  first = lib.stat().st_mtime_ns
  assert native.build(out) == lib and lib.stat().st_mtime_ns == first          # valid: not compiled again

  for change in ("another cpu", "other extensions", "truncated", "bit-flipped", "no manifest"):
    if change in ("another cpu", "other extensions"):
      edited = dict(_manifest(lib), **({"cpu": "Some Other CPU"} if change == "another cpu" else
                                       {"vector_extensions": ["avx512f"], "macros_sha256": "0" * 64}))
      native.manifest_path(lib).write_text(json.dumps(edited))
    elif change == "no manifest":
      native.manifest_path(lib).unlink()
    else:
      data = lib.read_bytes()
      lib.write_bytes(data[:len(data) // 2] if change == "truncated" else
                      data[:100] + bytes([data[100] ^ 1]) + data[101:])
    before = lib.stat().st_mtime_ns
    assert native.build(out) == lib, change
    assert lib.stat().st_mtime_ns != before and _built_for(lib) == manifest, change     # rebuilt, for this host
    assert ctypes.CDLL(str(lib)).Answer() == 42


@needs_compiler
def test_a_library_that_fails_to_load_is_rebuilt(small_source, tmp_path):
  out = tmp_path / "kernels"
  lib = native.build(out)
  lib.write_bytes(b"not a shared library")                   # and a manifest that vouches for it
  manifest = _manifest(lib)
  manifest["sha256"] = native._sha256(lib)
  native.manifest_path(lib).write_text(json.dumps(manifest))
  handle, path = native.load(out)
  assert path == lib and handle.Answer() == 42


@needs_compiler
@x86
def test_a_target_this_cpu_cannot_run_is_refused_not_built(small_source, tmp_path):
  flags = native.cpu_flags() or frozenset()
  have = {f.replace("_", "") for f in flags}
  absent = [m for m in ("avx512vp2intersect", "avx512fp16", "avx512bf16", "avx512f", "avx2")
            if m not in have]
  if not absent:
    pytest.skip("this CPU has every extension tried")
  with pytest.raises(RuntimeError, match=f"needs .*{absent[0]}.*does not list"):
    native.build(tmp_path / "kernels", ("-march=native", f"-m{absent[0]}"))
  assert not (tmp_path / "kernels").exists()


def test_native_build_has_no_warnings():
  if not ck.available():
    pytest.skip(f"CPU kernels {ck.status()}")
  lib = Path(ck.status()[len("on ("):-1])
  manifest = _manifest(lib)
  assert manifest["cpu"] == native.cpu_model() and "-Wall" in manifest["flags"] and "-w" not in manifest["flags"]
  assert "warning" not in manifest["compiler_output"], manifest["compiler_output"][-3000:]


# Each kernel's reference tests (the mixed attention at every bit width, so every Codes16 path).
REFERENCE_TESTS = [
    "tests/test_cpu_kernels.py::test_skinny_matmul_matches_reference",
    "tests/test_cpu_kernels.py::test_several_weights_in_one_call_match_reference",
    "tests/test_cpu_attention.py::test_kernel_matches_reference",
    "tests/test_cpu_attention.py::test_kernel_returns_the_last_rows_probabilities",
    "tests/test_cpu_attention.py::test_dense_kernel_matches_reference",
    "tests/test_cpu_select.py::test_top_k_indices_equal_lax_top_k",
    "tests/test_cpu_select.py::test_scatter_top_k_equals_the_dense_scores_top_k",
    "tests/test_cpu_select.py::test_take_rows_equals_take_along_axis_clipped",
    "tests/test_cpu_select.py::test_argmax_equals_jnp_argmax",
    "tests/test_cpu_prefill.py::test_kernel_equals_dense_references",
    "tests/test_kivi.py::test_ring_keys_kernel_equals_its_reference",
]


@needs_compiler
@x86
def test_kernels_without_avx512_match_their_references(tmp_path):
  """The kernels built with `-march=native -mno-avx512f` (their AVX2 paths: Exp's floor by conversions, no
  compress-store in the top-k) into a fresh folder, warning-free, then their reference tests in a process that
  loads that library (the same key: nothing is built twice)."""
  lib = native.build(tmp_path, NO_AVX512)
  manifest = _manifest(lib)
  assert not any(e.startswith("avx512") for e in manifest["vector_extensions"]), manifest["vector_extensions"]
  assert "warning" not in manifest["compiler_output"], manifest["compiler_output"][-3000:]
  env = dict(os.environ, SPECACHE_JAX_KERNEL_CACHE=str(tmp_path), SPECACHE_JAX_KERNEL_ARCH=" ".join(NO_AVX512))
  code = ("import sys, pytest\n"
          "from specache_jax import cpu_kernels as ck\n"
          f"assert ck.status() == 'on ({lib})', ck.status()\n"
          "sys.exit(pytest.main(['-q', '-n', '0', '-p', 'no:cacheprovider', '-rs', '-k', "
          "'not 20000 and not 8448', *sys.argv[1:]]))\n")
  done = subprocess.run([sys.executable, "-c", code, *REFERENCE_TESTS], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=1200)
  tail = done.stdout[-3000:] + done.stderr[-3000:]
  assert done.returncode == 0, tail
  assert " passed" in tail and "skipped" not in tail, tail
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted([lib.name, native.manifest_path(lib).name])
