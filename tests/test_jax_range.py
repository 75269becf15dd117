"""`pip install .` next to an installed jax keeps that jax (issue 43: a supported jax range, not a pin).

Runs in tools/test_jax011.sh's venv (.venv312: jax 0.11.2 on Python 3.12), which keeps the jax, jaxlib and
setuptools wheels it installed in `<venv>/wheels`; elsewhere (no such wheels for the running jax) it skips. A fresh
venv gets jax and jaxlib from those wheels (pip, no index), as a Colab or GPU image holds its own jax; the other
runtime dependencies are seen through a `.pth` line naming the running venv's site-packages (installing them again
would take minutes). Then `pip install --no-index --no-build-isolation <checkout copy>`: with no index pip cannot
replace jax, so a range that excluded the installed jax fails the install instead of downgrading it.
"""
from __future__ import annotations

import json
import pathlib
import re
import sys
import sysconfig

import jax
import pytest

import fresh_venv

WHEELS = pathlib.Path(sys.prefix) / "wheels"
INSTALL_TIMEOUT_S = 600

_CHECK = r"""
import json, jax, jaxlib, specache_jax, pallas_kernels
from importlib import metadata
print("RESULT " + json.dumps({
    "jax": jax.__version__, "jaxlib": jaxlib.__version__, "jax_file": jax.__file__,
    "specache_jax": specache_jax.__file__, "pallas_kernels": pallas_kernels.__file__,
    "dist_jax": metadata.version("jax"), "dist_specache_jax": metadata.version("specache_jax")}))
"""


def _wheel(name: str) -> pathlib.Path:
  found = sorted(WHEELS.glob(f"{name}-{jax.__version__}-*.whl"))
  if not found:
    pytest.skip(f"no {name}-{jax.__version__} wheel in {WHEELS}: run by tools/test_jax011.sh")
  return found[0]


def test_pip_install_of_the_checkout_keeps_the_installed_jax(tmp_path):
  jax_whl, jaxlib_whl = _wheel("jax"), _wheel("jaxlib")
  venv = fresh_venv.Venv(tmp_path / "venv")
  fresh_venv.run([sys.executable, "-m", "venv", venv.path], cwd=tmp_path, timeout=INSTALL_TIMEOUT_S)
  venv.pip("install", "--no-index", "--no-deps", "--quiet", jax_whl, jaxlib_whl)
  site = pathlib.Path(fresh_venv.run([venv.python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                     cwd=tmp_path).strip())
  (site / "zz_runtime_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n", encoding="utf-8")

  src = fresh_venv.copy_checkout(tmp_path / "src")
  log = fresh_venv.run([venv.python, "-m", "pip", "install", "--no-index", "--no-build-isolation", src],
                       cwd=tmp_path, timeout=INSTALL_TIMEOUT_S)
  assert re.search(r"^Successfully installed specache[-_]jax-0\.1\.0$", log, re.MULTILINE), log
  assert not re.search(r"(Collecting|Uninstalling|Installing collected packages:.*) jax", log), log

  outside = tmp_path / "elsewhere"                        # not the checkout: specache_jax comes from the venv
  outside.mkdir()
  got = json.loads(fresh_venv.run([venv.python, "-c", _CHECK], cwd=outside).split("RESULT ", 1)[1])
  assert got["jax"] == got["jaxlib"] == got["dist_jax"] == jax.__version__, got
  assert pathlib.Path(got["jax_file"]).resolve().is_relative_to(site.resolve()), got
  for key in ("specache_jax", "pallas_kernels"):
    assert pathlib.Path(got[key]).resolve().is_relative_to(site.resolve()), (key, got)
  assert got["dist_specache_jax"] == "0.1.0", got
