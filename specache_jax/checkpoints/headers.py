"""Bounds-checked parsing of safetensors and GGUF headers, before any third-party reader or large allocation.

Every count, length, shape and offset a header claims is checked against the bytes the file actually has, so a
truncated, bit-flipped or inflated header (a tensor claiming terabytes, a dimension past 2**63, an offset past
the end, a string or array longer than the file, overlapping or duplicated tensors) raises CheckpointError naming
the file, the tensor or key, and the bad value. Only headers are read: the data of a tensor is trusted once its
byte range lies inside the file, and a bit flip inside tensor data cannot be detected (neither format carries
checksums), nor can a GGUF type changed to another of the same size (F16 <-> BF16).
"""
from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import struct

from specache_jax.checkpoints import CheckpointError

# safetensors dtype -> bytes per element (the format's spec; sub-byte and complex types are not weights here)
SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
                      "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}
SAFETENSORS_MAX_HEADER = 100 << 20   # the safetensors library's own limit on the JSON header
INT64_MAX = (1 << 63) - 1

# GGUF value type -> struct code of its scalar (8 = string, 9 = array are handled apart)
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4
GGML_MAX_DIMS = 4


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """One tensor a header declares: `shape` in numpy order (outermost first), `begin` an absolute file offset."""
  name: str
  dtype: str               # a safetensors dtype name, or a GGML type name (F32, Q8_0, ...)
  shape: tuple[int, ...]
  begin: int
  nbytes: int


def _corrupt(file: str, detail: str) -> CheckpointError:
  return CheckpointError(f"{file} is truncated or corrupt: {detail}")


def _check_disjoint(file: str, infos: list[TensorInfo], end: int, contiguous_from: int | None = None) -> None:
  """Each tensor's bytes inside [.., end), no two overlapping (and, for safetensors, no holes)."""
  previous = None
  for info in sorted(infos, key=lambda t: (t.begin, t.nbytes)):
    if info.begin + info.nbytes > end:
      raise _corrupt(file, f"tensor {info.name!r} claims bytes [{info.begin}, {info.begin + info.nbytes}) "
                           f"past the end of the file ({end} bytes)")
    if previous is not None and info.begin < previous.begin + previous.nbytes:
      raise _corrupt(file, f"tensor {info.name!r} at bytes [{info.begin}, {info.begin + info.nbytes}) overlaps "
                           f"tensor {previous.name!r} at [{previous.begin}, {previous.begin + previous.nbytes})")
    if contiguous_from is not None:
      expect = contiguous_from if previous is None else previous.begin + previous.nbytes
      if info.begin != expect:
        raise _corrupt(file, f"tensor {info.name!r} starts at byte {info.begin}; expected {expect} (the data "
                             "must be packed without holes)")
    previous = info
  if contiguous_from is not None:
    last = contiguous_from if previous is None else previous.begin + previous.nbytes
    if last != end:
      raise _corrupt(file, f"the tensors cover bytes up to {last} of {end}; the rest is unaccounted for")


# ---- safetensors ----------------------------------------------------------------------------------------------

def _no_duplicates(pairs: list) -> dict:
  keys = [k for k, _ in pairs]
  duplicated = sorted({k for k in keys if keys.count(k) > 1})
  if duplicated:
    raise ValueError(f"duplicated keys {duplicated[:5]}")
  return dict(pairs)


def _int_list(value, length: int | None = None) -> list[int] | None:
  """`value` as a list of ints >= 0 (JSON booleans and floats refused), or None."""
  if not isinstance(value, list) or (length is not None and len(value) != length):
    return None
  if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= INT64_MAX for v in value):
    return None
  return value


def safetensors_header(file: str) -> dict[str, TensorInfo]:
  """The tensors of a .safetensors file, every entry checked against the file's size (CheckpointError)."""
  try:
    size = os.path.getsize(file)
    with open(file, "rb") as f:
      prefix = f.read(8)
      if len(prefix) < 8:
        raise _corrupt(file, f"{size} bytes is too short for the 8-byte header length")
      (n,) = struct.unpack("<Q", prefix)
      if n > min(size - 8, SAFETENSORS_MAX_HEADER):
        raise _corrupt(file, f"header length {n} exceeds the {size - 8} bytes after it (or the "
                             f"{SAFETENSORS_MAX_HEADER}-byte limit)")
      raw = f.read(n)
  except OSError as err:
    raise CheckpointError(f"{file} cannot be read: {err}") from err
  try:
    header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
  except (UnicodeDecodeError, ValueError, RecursionError) as err:
    raise _corrupt(file, f"the {n}-byte JSON header does not parse ({err})") from err
  if not isinstance(header, dict):
    raise _corrupt(file, f"the JSON header is a {type(header).__name__}; expected an object")
  start = 8 + n
  infos = []
  for name, entry in header.items():
    if name == "__metadata__":
      if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
        raise _corrupt(file, f"__metadata__={entry!r:.200} must map strings to strings")
      continue
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
      raise _corrupt(file, f"tensor {name!r} has entry {entry!r:.200}; expected dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], _int_list(entry["shape"]), _int_list(entry["data_offsets"], 2)
    if dtype not in SAFETENSORS_DTYPES:
      raise _corrupt(file, f"tensor {name!r} has dtype={dtype!r}; expected one of {tuple(SAFETENSORS_DTYPES)}")
    if shape is None:
      raise _corrupt(file, f"tensor {name!r} has shape={entry['shape']!r:.200}; expected a list of integers >= 0")
    if offsets is None or offsets[0] > offsets[1]:
      raise _corrupt(file, f"tensor {name!r} has data_offsets={entry['data_offsets']!r:.200}; expected "
                           "[begin, end] with 0 <= begin <= end")
    nbytes = math.prod(shape) * SAFETENSORS_DTYPES[dtype]
    if nbytes != offsets[1] - offsets[0]:
      raise _corrupt(file, f"tensor {name!r} of dtype {dtype} and shape {shape} needs {nbytes} bytes; its "
                           f"data_offsets={offsets} hold {offsets[1] - offsets[0]}")
    infos.append(TensorInfo(name, dtype, tuple(shape), start + offsets[0], nbytes))
  _check_disjoint(file, infos, size, contiguous_from=start)
  return {info.name: info for info in infos}


# ---- GGUF -----------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GGUFHeader:
  """What a GGUF header declares: the metadata keys with their value types, the tensors, where data starts."""
  byte_order: str                  # "<" or ">"
  version: int
  keys: dict[str, int]             # key -> GGUF value type
  alignment: int
  data_offset: int
  tensors: dict[str, TensorInfo]


class _Cursor:
  """Reads GGUF scalars and strings from a buffer, each read checked against the end of the file."""

  def __init__(self, file: str, buf, order: str):
    self.file, self.buf, self.order, self.pos = file, buf, order, 0

  @property
  def left(self) -> int:
    return len(self.buf) - self.pos

  def take(self, code: str, what: str):
    width = struct.calcsize(code)
    if self.pos + width > len(self.buf):
      raise _corrupt(self.file, f"{what} at byte {self.pos} runs past the end of the file ({len(self.buf)} bytes)")
    (value,) = struct.unpack_from(self.order + code, self.buf, self.pos)
    self.pos += width
    return value

  def count(self, what: str, min_item: int):
    """A u64 count of items, each at least `min_item` bytes, that must fit in the rest of the file."""
    n = self.take("Q", what)
    if n * min_item > self.left:
      raise _corrupt(self.file, f"{what}={n} at byte {self.pos - 8} cannot fit in the {self.left} bytes left in "
                                "the file")
    return n

  def string(self, what: str) -> str:
    n = self.count(f"{what} length", 1)
    raw = bytes(self.buf[self.pos:self.pos + n])
    self.pos += n
    try:
      return raw.decode("utf-8")
    except UnicodeDecodeError as err:
      raise _corrupt(self.file, f"{what} at byte {self.pos - n} is not UTF-8 ({err})") from err

  def skip_value(self, vtype: int, what: str, in_array: bool = False):
    """Skip (checking) one value of GGUF type `vtype`; returns it for scalars and strings, None for arrays."""
    if vtype in _GGUF_SCALARS:
      return self.take(_GGUF_SCALARS[vtype], what)
    if vtype == _GGUF_STRING:
      return self.string(what)
    if vtype == _GGUF_ARRAY and not in_array:
      item = self.take("I", f"{what} item type")
      if item not in _GGUF_SCALARS and item != _GGUF_STRING:
        raise _corrupt(self.file, f"{what} has item type {item}; expected a scalar or string type (0-8, 10-12)")
      width = 8 if item == _GGUF_STRING else struct.calcsize(_GGUF_SCALARS[item])
      n = self.count(f"{what} item count", width)
      if item in _GGUF_SCALARS:
        self.pos += n * width
      else:
        for i in range(n):
          self.string(f"{what}[{i}]")
      return None
    raise _corrupt(self.file, f"{what} has value type {vtype}; expected 0-12 (arrays of arrays unsupported)")


def gguf_header(file: str) -> GGUFHeader:
  """The header of a GGUF file (v2/v3, either byte order), every claim checked against the file's size."""
  from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
  try:
    with open(file, "rb") as f:
      size = os.fstat(f.fileno()).st_size
      if size < 24:
        raise _corrupt(file, f"{size} bytes is too short for a GGUF header (magic, version, counts)")
      with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _parse_gguf(file, buf, GGML_QUANT_SIZES, GGMLQuantizationType)
  except OSError as err:
    raise CheckpointError(f"{file} cannot be read: {err}") from err


def _parse_gguf(file: str, buf, quant_sizes, quant_types) -> GGUFHeader:
  if bytes(buf[:4]) != b"GGUF":
    raise _corrupt(file, f"magic={bytes(buf[:4])!r}; expected b'GGUF'")
  (version,) = struct.unpack_from("<I", buf, 4)
  order = ">" if version & 0xFFFF == 0 else "<"   # the gguf reader's rule for a byte-swapped file
  cur = _Cursor(file, buf, order)
  cur.pos = 4
  version = cur.take("I", "version")
  if version not in (2, 3):
    raise _corrupt(file, f"GGUF version={version}; expected 2 or 3")
  n_tensors = cur.take("Q", "tensor count")
  n_keys = cur.count("key count", 8 + 4 + 1)
  if n_tensors * (8 + 4 + 4 + 8) > cur.left:
    raise _corrupt(file, f"tensor count={n_tensors} cannot fit in the {cur.left} bytes left in the file")
  keys: dict[str, int] = {}
  alignment = 32
  for k in range(n_keys):
    key = cur.string(f"key #{k}")
    if key in keys:
      raise _corrupt(file, f"metadata key {key!r} appears twice")
    keys[key] = vtype = cur.take("I", f"value type of {key!r}")
    value = cur.skip_value(vtype, f"metadata {key!r}")
    if key == "general.alignment":
      if vtype != _GGUF_UINT32 or value == 0 or value & (value - 1):
        raise _corrupt(file, f"general.alignment={value!r} (type {vtype}) must be a uint32 power of two")
      alignment = value
  pending = []
  for t in range(n_tensors):
    name = cur.string(f"tensor #{t} name")
    n_dims = cur.take("I", f"tensor {name!r} dimension count")
    if not 1 <= n_dims <= GGML_MAX_DIMS:
      raise _corrupt(file, f"tensor {name!r} has n_dims={n_dims}; expected 1 to {GGML_MAX_DIMS}")
    dims = [cur.take("Q", f"tensor {name!r} dimension") for _ in range(n_dims)]
    raw_type = cur.take("I", f"tensor {name!r} type")
    offset = cur.take("Q", f"tensor {name!r} offset")
    pending.append((name, dims, raw_type, offset))
  data_offset = -(-cur.pos // alignment) * alignment
  if data_offset > len(buf):
    raise _corrupt(file, f"the tensor data would start at byte {data_offset}, past the end ({len(buf)} bytes)")
  tensors: dict[str, TensorInfo] = {}
  for name, dims, raw_type, offset in pending:
    if name in tensors:
      raise _corrupt(file, f"tensor {name!r} appears twice")
    try:
      qtype = quant_types(raw_type)
      block, type_size = quant_sizes[qtype]
    except (ValueError, KeyError) as err:
      raise _corrupt(file, f"tensor {name!r} has GGML type={raw_type}, which is unknown") from err
    if any(d == 0 or d > INT64_MAX for d in dims):
      raise _corrupt(file, f"tensor {name!r} has dims={dims}; each must be in [1, 2**63)")
    if dims[0] % block:
      raise _corrupt(file, f"tensor {name!r} of type {qtype.name} has dims={dims}; the first must be a multiple "
                           f"of the block size {block}")
    if offset % alignment:
      raise _corrupt(file, f"tensor {name!r} has offset={offset}, not a multiple of the alignment {alignment}")
    nbytes = math.prod(dims) // block * type_size
    tensors[name] = TensorInfo(name, qtype.name, tuple(reversed(dims)), data_offset + offset, nbytes)
  _check_disjoint(file, list(tensors.values()), len(buf))
  expect = 0   # llama.cpp's rule: tensors packed in header order, each padded to the alignment
  for name, _, _, offset in pending:
    if offset != expect:
      raise _corrupt(file, f"tensor {name!r} has offset={offset}; expected {expect} (tensors are packed in "
                           f"header order, each padded to {alignment} bytes)")
    expect += -(-tensors[name].nbytes // alignment) * alignment
  if pending:
    last = tensors[pending[-1][0]]
    if not last.begin + last.nbytes <= len(buf) <= data_offset + expect:
      raise _corrupt(file, f"the file has {len(buf)} bytes; its last tensor {last.name!r} ends at byte "
                           f"{last.begin + last.nbytes} (padded: {data_offset + expect})")
  return GGUFHeader(order, version, keys, alignment, data_offset, tensors)
