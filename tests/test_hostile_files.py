"""Hostile checkpoint files: truncated, bit-flipped and header-inflated safetensors, GGUF and orbax inputs.

Property tests generate corruptions of tiny real checkpoints (written by hostile_fixtures.py) and load each one under
an address-space limit 1 GiB above what the process maps and a time limit (`bounded`). Every load either

- refuses with the project's error (CheckpointError / ConfigError) naming the file, with no MemoryError anywhere in
  its cause chain (no allocation was attempted for the claimed size), or
- loads params whose every shape is `param_shapes` of the config it returns (never a silent wrong shape), with the
  data equal to the pristine load except where the corruption touched tensor data: a bit flip inside tensor data
  cannot be detected (neither safetensors, GGUF nor orbax's zstd chunks carry checksums), so such a flip loads,
  with at most the elements around the flipped byte changed (one for float32, one Q8_0 block of 32). A GGUF type
  changed to another of the same byte size (F16 <-> BF16) would be as undetectable; the generated corruptions
  cannot reach one.

The corruptions: truncation at any byte, 1-4 bit flips (half in the header), and structured header edits (a
dimension, dtype, offset, count, length or type set to 0, 2**32, 2**63, 2**64 - 1, another tensor's offset, ...;
a tensor dropped, duplicated or renamed; config.json and the orbax marker's fields set to hostile JSON values;
orbax files deleted or truncated). Named cases then pin the message for each hostile header the issue lists.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import struct

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest

import hostile_fixtures as hx
from specache_jax.checkpoints import CheckpointError, orbax as orbax_io
from specache_jax.checkpoints.gguf import load_gguf
from specache_jax.checkpoints.hf import load_hf
from specache_jax.errors import ConfigError
from specache_jax.model.init import param_shapes

# A failed orbax restore leaves its coroutines and event loop behind (orbax's own "Exception ignored" noise).
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
HOSTILE_U64 = [0, 1, 2, 7, 31, 32, 33, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
HOSTILE_U32 = [0, 1, 3, 5, 8, 9, 12, 13, 2**16, 2**31, 2**32 - 1]
HOSTILE_JSON = [0, -1, 1, 3, 2**31, 2**40, 2**63, 2**64 + 5, -(2**63), 1.5, float("nan"), "2", None, [], {}, True]


class _Pristine(dict):
  def __repr__(self):   # hypothesis prints the arguments of a failing example
    return f"<pristine checkpoints: {sorted(self)}>"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
  """Each format's pristine files and what loading them gives."""
  root = tmp_path_factory.mktemp("pristine")
  params = hx.random_params()
  hf_dir = hx.write_hf(str(root / "hf"), params)
  gguf_file = hx.write_gguf(str(root / "m.gguf"), params)
  cfg_g, params_g, _ = load_gguf(gguf_file)
  orbax_dir = orbax_io.save(str(root / "orbax"), hx.CFG, jax.tree.map(jax.numpy.asarray, params),
                            hx.tiny_tokenizer())
  orbax_io.restore(orbax_dir)   # warm up orbax / tensorstore (threads, pools) outside the memory limit
  fields, gguf_data = hx.gguf_fields(gguf_file)
  st_bytes = (root / "hf" / "model.safetensors").read_bytes()
  return _Pristine(params=params, hf_dir=hf_dir, st_bytes=st_bytes,
                   st_data=8 + struct.unpack("<Q", st_bytes[:8])[0], gguf_file=gguf_file,
                   gguf_bytes=(root / "m.gguf").read_bytes(), gguf_fields=fields, gguf_data=gguf_data,
                   gguf_cfg=cfg_g, gguf_params=params_g, orbax_dir=orbax_dir)


def _cause_chain(err: BaseException) -> list[BaseException]:
  chain = []
  while err is not None and err not in chain:
    chain.append(err)
    err = err.__cause__ or err.__context__
  return chain


def _differing(a: dict, b: dict) -> int:
  """How many elements differ bit for bit between two params trees of equal shapes (as float32)."""
  n = 0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    n += int(np.count_nonzero(x.view(np.uint32) != y.view(np.uint32)))
  return n


def _gist(message: str) -> str:
  """An error message without its paths and numbers (for hypothesis' statistics)."""
  return re.sub(r"(/[^ :]+)|\d+|'[^']*'", "_", message)[:90]


def _load_or_refuse(load, names: str):
  """-> (cfg, params) or None when refused; asserts the refusal is the project's error naming `names`."""
  try:
    with hx.bounded():
      cfg, params = load()
  except (CheckpointError, ConfigError) as err:
    hypothesis.event(f"refused: {type(err).__name__}: {_gist(str(err))}")
    assert not any(isinstance(e, MemoryError) for e in _cause_chain(err)), f"a large allocation was tried: {err!r}"
    assert names in str(err), f"the error does not name {names}: {err}"
    return None
  hypothesis.event("loaded")
  shapes = jax.tree.map(lambda x: tuple(x.shape), params)
  assert shapes == param_shapes(cfg), "a load with shapes that disagree with its config"
  return cfg, params


def _flip(data: bytes, flips: list[tuple[int, int]]) -> bytes:
  out = bytearray(data)
  for pos, bit in flips:
    out[pos % len(out)] ^= 1 << bit
  return bytes(out)


def _flips(size: int, hot: int):
  """1-4 (byte, bit) flips, half of them inside the first `hot` bytes (the header)."""
  pos = st.one_of(st.integers(0, hot - 1), st.integers(0, size - 1))
  return st.lists(st.tuples(pos, st.integers(0, 7)), min_size=1, max_size=4)


# ---- safetensors ----------------------------------------------------------------------------------------------

@st.composite
def _st_corruption(draw, names: list[str], size: int, data_start: int):
  """A corruption of the pristine model.safetensors, as a small tuple (hypothesis prints it on failure)."""
  kind = draw(st.sampled_from(["truncate", "flip", "shape", "dtype", "offsets", "drop", "duplicate",
                               "header_length"]))
  if kind == "truncate":
    return kind, draw(st.integers(0, size - 1))
  if kind == "flip":
    return kind, draw(_flips(size, data_start))
  if kind == "header_length":
    return kind, draw(st.sampled_from(HOSTILE_U64))
  name = draw(st.sampled_from(names))
  if kind == "shape":   # replace or insert one dimension
    return kind, name, draw(st.integers(0, 2)), draw(st.sampled_from(HOSTILE_JSON + HOSTILE_U64))
  if kind == "dtype":
    return kind, name, draw(st.sampled_from(["F16", "BF16", "F64", "I32", "U32", "I64", "BOOL", "F8_E4M3", "Q4",
                                             "", 7]))
  if kind == "offsets":   # hostile numbers, another tensor's range, or a malformed list
    pick = st.one_of(st.sampled_from(HOSTILE_JSON + HOSTILE_U64), st.integers(0, size))
    return kind, name, draw(st.one_of(st.lists(pick, min_size=2, max_size=2), st.sampled_from(names),
                                      st.lists(pick, max_size=3)))
  return kind, name


def _st_apply(corruption: tuple, data: bytes, data_start: int) -> bytes:
  kind, *args = corruption
  if kind == "truncate":
    return data[:args[0]]
  if kind == "flip":
    return _flip(data, args[0])
  if kind == "header_length":
    return struct.pack("<Q", args[0]) + data[8:]
  header = json.loads(data[8:data_start])
  name, entry = args[0], header[args[0]]
  if kind == "shape":
    entry["shape"][args[1]:args[1] + 1] = [args[2]]
  elif kind == "dtype":
    entry["dtype"] = args[1]
  elif kind == "offsets":
    entry["data_offsets"] = header[args[1]]["data_offsets"] if isinstance(args[1], str) else args[1]
  elif kind == "drop":
    del header[name]
  text = json.dumps(header)
  if kind == "duplicate":
    text = text[:-1] + f', "{name}": ' + json.dumps(entry) + "}"
  raw = text.encode()
  return struct.pack("<Q", len(raw)) + raw + data[data_start:]


@hypothesis.settings(max_examples=120, **SETTINGS)
@hypothesis.given(st.data())
def test_corrupted_safetensors_load_identically_or_are_refused(pristine, tmp_path, data):
  blob, start = pristine["st_bytes"], pristine["st_data"]
  names = sorted(k for k in json.loads(blob[8:start]) if k != "__metadata__")
  corruption = data.draw(_st_corruption(names, len(blob), start))
  path = tmp_path / "hf"
  if not path.exists():
    shutil.copytree(pristine["hf_dir"], path)
  (path / "model.safetensors").write_bytes(_st_apply(corruption, blob, start))
  loaded = _load_or_refuse(lambda: load_hf(str(path)), "model.safetensors")
  if loaded is not None:
    assert loaded[0] == dataclasses.replace(hx.CFG, name="hf")
    changed = _differing(loaded[1], pristine["params"])
    flips = corruption[1] if corruption[0] == "flip" else []
    in_data = [f for f in flips if f[0] % len(blob) >= start]
    # float32 data: a flip changes one element; a header change that loads (e.g. inside __metadata__) none
    assert changed <= len(in_data), f"{changed} elements changed by {len(in_data)} flips in tensor data"


@hypothesis.settings(max_examples=60, **SETTINGS)
@hypothesis.given(key=st.sampled_from(sorted(hx.hf_config())), value=st.sampled_from(
    HOSTILE_JSON + [10**6, 10**12, 2**40 + 1, -7, "silu", "gelu", {"rope_type": "yarn"}]))
def test_hostile_config_json_values_are_refused_or_load_consistent_shapes(pristine, tmp_path, key, value):
  path = tmp_path / "hf"
  if not path.exists():
    shutil.copytree(pristine["hf_dir"], path)
  (path / "config.json").write_text(json.dumps({**hx.hf_config(), key: value}))
  loaded = _load_or_refuse(lambda: load_hf(str(path)), str(path))
  if loaded is not None:   # a value that leaves the shapes alone (eps, theta, ids, ...) loads the same tensors
    assert _differing(loaded[1], pristine["params"]) == 0


# ---- GGUF -----------------------------------------------------------------------------------------------------

@st.composite
def _gguf_corruption(draw, fields: list, size: int, data_start: int):
  """A corruption of the pristine GGUF, as a small tuple: truncate, flip, a header field set to a hostile
  value, or one tensor renamed to another's name (a duplicate and a missing tensor)."""
  kind = draw(st.sampled_from(["truncate", "flip", "field", "field", "rename"]))
  if kind == "truncate":
    return kind, draw(st.integers(0, size - 1))
  if kind == "flip":
    return kind, draw(_flips(size, data_start))
  if kind == "rename":
    names = sorted({w[: -len(" name length")] for w, _, _ in fields if w.endswith(" name length")})
    a = draw(st.sampled_from(names))
    return kind, a, draw(st.sampled_from([n for n in names if len(n) == len(a) and n != a] or [a]))
  what, _, width = draw(st.sampled_from(fields))
  offsets = sorted({p for w, p, _ in fields if w.endswith(" offset")})
  hostile = st.sampled_from(HOSTILE_U64 if width == 8 else HOSTILE_U32)
  delta = st.sampled_from(["-1", "+1", "*2", "+32"] + (["offset of another tensor"] if width == 8 else []))
  return kind, what, draw(st.one_of(hostile, delta))


def _gguf_apply(corruption: tuple, data: bytes, fields: list) -> bytes:
  kind, *args = corruption
  if kind == "truncate":
    return data[:args[0]]
  if kind == "flip":
    return _flip(data, args[0])
  at = {w: (p, width) for w, p, width in fields}
  out = bytearray(data)
  if kind == "rename":
    pos = at[f"{args[0]} name length"][0] + 8
    out[pos:pos + len(args[1])] = args[1].encode()
    return bytes(out)
  pos, width = at[args[0]]
  code = "<Q" if width == 8 else "<I"
  old, value = struct.unpack_from(code, data, pos)[0], args[1]
  if isinstance(value, str):
    others = [struct.unpack_from("<Q", data, p)[0] for w, (p, _) in at.items() if w.endswith(" offset")]
    value = {"-1": old - 1, "+1": old + 1, "*2": old * 2, "+32": old + 32}.get(value, max(others))
  struct.pack_into(code, out, pos, value % 2**(8 * width))
  return bytes(out)


@hypothesis.settings(max_examples=150, **SETTINGS)
@hypothesis.given(st.data())
def test_corrupted_gguf_files_load_identically_or_are_refused(pristine, tmp_path, data):
  blob, fields, start = pristine["gguf_bytes"], pristine["gguf_fields"], pristine["gguf_data"]
  corruption = data.draw(_gguf_corruption(fields, len(blob), start))
  path = tmp_path / "bad.gguf"
  path.write_bytes(_gguf_apply(corruption, blob, fields))
  loaded = _load_or_refuse(lambda: load_gguf(str(path))[:2], "bad.gguf")
  if loaded is not None:
    changed = _differing(loaded[1], pristine["gguf_params"])
    flips = corruption[1] if corruption[0] == "flip" else []
    in_data = [f for f in flips if f[0] % len(blob) >= start]
    if in_data:
      assert loaded[0].n_layers == hx.CFG.n_layers
    # one Q8_0 block (32 elements) or one F16/F32 element per flip in tensor data; a header change that loads
    # (a metadata value, a value's type, the tokens) leaves every tensor as it was
    assert changed <= 32 * len(in_data), f"{changed} elements changed by {len(in_data)} flips in tensor data"


# ---- orbax ----------------------------------------------------------------------------------------------------

def _orbax_files(directory: str) -> list[str]:
  return sorted(os.path.relpath(os.path.join(r, f), directory) for r, _, fs in os.walk(directory) for f in fs)


@st.composite
def _orbax_corruption(draw, files: list[str], sizes: dict[str, int], marker: dict, tree_keys: list[str]):
  """A corruption of a copy of the pristine orbax directory, as a small tuple."""
  kind = draw(st.sampled_from(["truncate", "flip", "delete", "config", "dtype", "metadata"]))
  if kind == "config":
    return kind, draw(st.sampled_from(sorted(marker["config"]))), draw(st.sampled_from(
        HOSTILE_JSON + [10**6, 10**12, 2**40 + 1]))
  if kind == "dtype":
    return kind, draw(st.sampled_from([["bfloat16"], ["int8"], [], ["float32", "float16"], "float32", [3]]))
  if kind == "metadata":   # orbax's own tree metadata: an array's recorded write shape
    return kind, draw(st.sampled_from(tree_keys)), draw(st.lists(st.sampled_from(HOSTILE_JSON + HOSTILE_U64),
                                                                   max_size=4))
  name = draw(st.sampled_from(files))
  if kind == "delete":
    return kind, name
  if kind == "truncate":
    return kind, name, draw(st.integers(0, max(sizes[name] - 1, 0)))
  return kind, name, draw(_flips(max(sizes[name], 1), max(min(sizes[name], 64), 1)))


def _orbax_apply(corruption: tuple, directory: str) -> None:
  kind, *args = corruption
  if kind in ("config", "dtype"):
    with open(os.path.join(directory, orbax_io.MARKER)) as f:
      meta = json.load(f)
    if kind == "config":
      meta["config"][args[0]] = args[1]
    else:
      meta["dtype"] = args[0]
    with open(os.path.join(directory, orbax_io.MARKER), "w") as f:
      json.dump(meta, f)
    return
  if kind == "metadata":
    file = os.path.join(directory, "params", "_METADATA")
    with open(file) as f:
      meta = json.load(f)
    meta["tree_metadata"][args[0]]["value_metadata"]["write_shape"] = args[1]
    with open(file, "w") as f:
      json.dump(meta, f)
    return
  file = os.path.join(directory, args[0])
  if kind == "delete":
    os.remove(file)
  elif kind == "truncate":
    os.truncate(file, args[1])
  else:
    with open(file, "rb") as f:
      raw = f.read()
    if raw:
      with open(file, "wb") as f:
        f.write(_flip(raw, args[1]))


@hypothesis.settings(max_examples=90, **SETTINGS)
@hypothesis.given(st.data())
def test_corrupted_orbax_directories_load_identically_or_are_refused(pristine, tmp_path, data):
  source = pristine["orbax_dir"]
  files = _orbax_files(source)
  with open(os.path.join(source, orbax_io.MARKER)) as f:
    marker = json.load(f)
  with open(os.path.join(source, "params", "_METADATA")) as f:
    tree_keys = sorted(json.load(f)["tree_metadata"])
  corruption = data.draw(_orbax_corruption(files, {n: os.path.getsize(os.path.join(source, n)) for n in files},
                                           marker, tree_keys))
  path = tmp_path / "orbax"
  shutil.rmtree(path, ignore_errors=True)
  shutil.copytree(source, path)
  _orbax_apply(corruption, str(path))
  loaded = _load_or_refuse(lambda: orbax_io.restore(str(path))[:2], str(path))
  if loaded is not None and corruption[0] in ("flip", "truncate", "delete") and "/d/" in f"/{corruption[1]}":
    assert loaded[0] == hx.CFG   # a flip inside a compressed chunk: same config, shapes checked above


# ---- named cases: the message for each hostile header ---------------------------------------------------------

def _st_header_edit(edit):
  def apply(blob: bytes, start: int) -> bytes:
    header = json.loads(blob[8:start])
    edit(header)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + blob[start:]
  return apply


def _st_without(blob: bytes, name: str) -> bytes:
  """The safetensors file rewritten without tensor `name`."""
  from safetensors.numpy import load, save
  tensors = load(blob)
  del tensors[name]
  return save(tensors)


EMBED = "model.embed_tokens.weight"
SAFETENSORS_CASES = {
    "tensor claims terabytes": (_st_header_edit(lambda h: h[EMBED].update(shape=[2**20, 2**20])),
                                r"'model\.embed_tokens\.weight' of dtype F32 and shape \[1048576, 1048576\] needs "
                                r"4398046511104 bytes"),
    "negative dimension": (_st_header_edit(lambda h: h[EMBED].update(shape=[-64, 32])),
                           r"'model\.embed_tokens\.weight' has shape=\[-64, 32\]; expected a list of integers"),
    "offset past the end": (_st_header_edit(lambda h: h["model.norm.weight"].update(
        data_offsets=[2**40, 2**40 + 128])), r"'model\.norm\.weight' claims bytes \[\d+, \d+\) past the end"),
    "dtype disagrees with the bytes": (_st_header_edit(lambda h: h[EMBED].update(dtype="F64")),
                                       r"dtype F64 and shape \[64, 32\] needs 16384 bytes; its data_offsets="
                                       r"\[8192, 16384\] hold 8192"),
    "header length past the file": (lambda blob, start: struct.pack("<Q", 2**62) + blob[8:],
                                    r"header length 4611686018427387904 exceeds the \d+ bytes after it"),
    "overlapping tensors": (_st_header_edit(lambda h: h["model.norm.weight"].update(
        data_offsets=h["model.layers.1.input_layernorm.weight"]["data_offsets"])), r"overlaps tensor"),
    "duplicated tensor": (lambda blob, start: _st_apply(("duplicate", EMBED), blob, start), r"duplicated keys"),
    "missing tensor": (lambda blob, start: _st_without(blob, "model.layers.1.mlp.up_proj.weight"),
                       r"model\.safetensors is missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"),
    "integer weights": (_st_header_edit(lambda h: h[EMBED].update(dtype="I32")),
                        r"'model\.embed_tokens\.weight' in \S+model\.safetensors has dtype=I32"),
}


@pytest.mark.parametrize("case", sorted(SAFETENSORS_CASES))
def test_hostile_safetensors_headers_name_the_tensor_and_value(pristine, tmp_path, case):
  damage, message = SAFETENSORS_CASES[case]
  path = shutil.copytree(pristine["hf_dir"], tmp_path / "hf")
  (path / "model.safetensors").write_bytes(damage(pristine["st_bytes"], pristine["st_data"]))
  with hx.bounded(), pytest.raises(CheckpointError, match=message) as err:
    load_hf(str(path))
  assert "model.safetensors" in str(err.value)


GGUF_CASES = {   # (header field -> value, message)
    "tensor claims terabytes": (("token_embd.weight dim 1", 2**40),
                                r"'token_embd\.weight' claims bytes \[\d+, \d+\) past the end"),
    "dimension past 2**63 (negative as int64)": (("token_embd.weight dim 0", 2**64 - 32),
                                                 r"'token_embd\.weight' has dims=\[18446744073709551584, 64\]"),
    "offset past the end": (("output_norm.weight offset", 2**40), r"'output_norm\.weight' claims bytes"),
    "type disagrees with the bytes": (("output_norm.weight type", 1),
                                      r"offset=\d+; expected \d+ \(tensors are packed"),
    "tensor count past the file": (("GGUF.tensor_count", 2**62), r"tensor count=4611686018427387904 cannot fit"),
    "array count the gguf reader would loop over": (("tokenizer.ggml.tokens count", 2**62),
                                                    r"'tokenizer\.ggml\.tokens' item count=4611686018427387904"),
    "string longer than the file": (("general.architecture value length", 2**63),
                                    r"'general\.architecture' length=9223372036854775808 at byte \d+ cannot fit"),
    "five dimensions": (("output_norm.weight n_dims", 5), r"'output_norm\.weight' has n_dims=5; expected 1 to 4"),
    "overlapping tensors": (("blk.1.attn_norm.weight offset", "offset of another tensor"), r"overlaps tensor"),
}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_hostile_gguf_headers_name_the_tensor_and_value(pristine, tmp_path, case):
  (field, value), message = GGUF_CASES[case]
  blob, fields = pristine["gguf_bytes"], pristine["gguf_fields"]
  path = tmp_path / "bad.gguf"
  path.write_bytes(_gguf_apply(("field", field, value), blob, fields))
  with hx.bounded(), pytest.raises(CheckpointError, match=message) as err:
    load_gguf(str(path))
  assert "bad.gguf" in str(err.value)


def test_gguf_tensors_renamed_are_a_duplicate_and_a_missing_tensor(pristine, tmp_path):
  blob, fields = pristine["gguf_bytes"], pristine["gguf_fields"]
  path = tmp_path / "bad.gguf"
  path.write_bytes(_gguf_apply(("rename", "blk.0.ffn_up.weight", "blk.1.ffn_up.weight"), blob, fields))
  with hx.bounded(), pytest.raises(CheckpointError, match=r"bad\.gguf.*'blk\.1\.ffn_up\.weight' appears twice"):
    load_gguf(str(path))


ORBAX_CASES = {
    "config claims terabytes": (lambda m: m["config"].update(vocab_size=2**40),
                                r"needs \d+ bytes of params, more than this machine's \d+ bytes of memory"),
    "negative dimension": (lambda m: m["config"].update(dim=-32), r"dim=-32 must be a positive integer"),
    "config disagrees with the stored arrays": (lambda m: m["config"].update(n_layers=3),
                                                r"param 'layers\.attn_norm' is stored with shape \(2, 32\)"),
    "dtype disagrees with the stored arrays": (lambda m: m.update(dtype=["bfloat16"]),
                                               r"stored with shape \(64, 32\) and dtype float32; the config needs "
                                               r"shape \(64, 32\) and dtype bfloat16"),
    "config not an object": (lambda m: m.update(config=[1, 2]), r"saved model config \[1, 2\] is not an object"),
}


@pytest.mark.parametrize("case", sorted(ORBAX_CASES))
def test_hostile_orbax_markers_name_the_value(pristine, tmp_path, case):
  edit, message = ORBAX_CASES[case]
  path = shutil.copytree(pristine["orbax_dir"], tmp_path / "orbax")
  meta = json.loads((path / orbax_io.MARKER).read_text())
  edit(meta)
  (path / orbax_io.MARKER).write_text(json.dumps(meta))
  with hx.bounded(), pytest.raises(CheckpointError, match=message) as err:
    orbax_io.restore(str(path))
  assert str(path) in str(err.value)


def test_sharded_index_pointing_at_the_wrong_shard_or_outside_the_directory(pristine, tmp_path):
  from safetensors.numpy import load, save
  path = shutil.copytree(pristine["hf_dir"], tmp_path / "hf")
  tensors = load(pristine["st_bytes"])
  os.remove(path / "model.safetensors")
  names = sorted(tensors)
  halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
  for shard, members in halves.items():
    (path / shard).write_bytes(save({n: tensors[n] for n in members}))
  weight_map = {n: shard for shard, members in halves.items() for n in members}
  index = path / "model.safetensors.index.json"
  index.write_text(json.dumps({"weight_map": weight_map}))
  cfg, params = load_hf(str(path))
  assert _differing(params, pristine["params"]) == 0
  index.write_text(json.dumps({"weight_map": {**weight_map, "model.norm.weight": "a.safetensors"}}))
  with pytest.raises(CheckpointError, match=r"lists tensor 'model\.norm\.weight' in \S+a\.safetensors, whose "
                                            r"header lacks it"):
    load_hf(str(path))
  index.write_text(json.dumps({"weight_map": {**weight_map, "model.norm.weight": "../b.safetensors"}}))
  with pytest.raises(CheckpointError, match=r"maps tensors to \['\.\./b\.safetensors'\]; expected shard file "
                                            r"names"):
    load_hf(str(path))


def test_a_config_claiming_billions_of_layers_is_refused_before_listing_their_tensors(pristine, tmp_path):
  path = shutil.copytree(pristine["hf_dir"], tmp_path / "hf")
  config = json.loads((path / "config.json").read_text())
  (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**12}))
  with hx.bounded(), pytest.raises(CheckpointError, match=r"model\.safetensors: the config's n_layers="
                                                          r"1000000000000 needs 9000000000000 layer tensors"):
    load_hf(str(path))
  blob = bytearray(pristine["gguf_bytes"])
  at = {what: pos for what, pos, _ in pristine["gguf_fields"]}
  struct.pack_into("<I", blob, at["llama.block_count type"] + 4, 2**32 - 1)   # the u32 value after its type
  (tmp_path / "bad.gguf").write_bytes(bytes(blob))
  with hx.bounded(), pytest.raises(CheckpointError, match=r"bad\.gguf: the config's n_layers=4294967295 needs"):
    load_gguf(str(tmp_path / "bad.gguf"))
