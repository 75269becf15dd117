"""Extract Jane Austen's six novels from Debian's ``r-cran-janeaustenr`` into ``data/austen/*.txt``.

Run from the repository root (needs ``apt-get``, not R):

    python tools/extract_austen.py                      # apt-get download + dpkg-deb -x in a temp dir
    python tools/extract_austen.py --package-dir DIR    # DIR = an already extracted janeaustenr/ folder

The package keeps its data in an R lazy-load database: ``data/Rdata.rdx`` is a gzip-compressed R
serialization of ``list(variables = list(<name> = c(offset, length)), references, compressed)``;
each object in ``data/Rdata.rdb`` at ``offset`` is a 4-byte big-endian uncompressed length followed by a
zlib stream holding the R serialization (XDR, version 2 or 3) of a character vector (one novel, one line
per element). This file implements just enough of R's serialization format to read those objects.
"""
from __future__ import annotations

import argparse
import gzip
import pathlib
import struct
import subprocess
import tempfile
import zlib
from typing import Any

# R object name -> (file stem, title). Public-domain novels only; nothing else is written.
NOVELS = {
    "sensesensibility": ("sense_and_sensibility", "Sense and Sensibility"),
    "prideprejudice": ("pride_and_prejudice", "Pride and Prejudice"),
    "mansfieldpark": ("mansfield_park", "Mansfield Park"),
    "emma": ("emma", "Emma"),
    "northangerabbey": ("northanger_abbey", "Northanger Abbey"),
    "persuasion": ("persuasion", "Persuasion"),
}
DEBIAN_PACKAGE = "r-cran-janeaustenr"

# SEXP type codes and the special pseudo-types of R's serialize.c.
NILSXP, SYMSXP, LISTSXP, LANGSXP, CHARSXP = 0, 1, 2, 6, 9
LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP, EXPRSXP, RAWSXP = 10, 13, 14, 16, 19, 20, 24
REFSXP, NILVALUE_SXP, EMPTYENV_SXP, BASEENV_SXP, GLOBALENV_SXP = 255, 254, 242, 241, 253
NA_INTEGER = -(2**31)


class RPairList(list):
  """A serialized pairlist (attributes): a list of (tag, value) pairs."""


class RVector:
  """An R vector with its attributes (names, class, levels, row.names ...)."""

  def __init__(self, sexptype: int, values: list, attributes: dict[str, Any]):
    self.sexptype = sexptype
    self.values = values
    self.attributes = attributes

  def __repr__(self):
    return f"RVector(type={self.sexptype}, n={len(self.values)}, attrs={sorted(self.attributes)})"


class XdrReader:
  """Reads one R serialization stream in XDR (big-endian) format."""

  def __init__(self, data: bytes):
    self.data = data
    self.pos = 0
    self.refs: list[Any] = []

  def _take(self, n: int) -> bytes:
    if self.pos + n > len(self.data):
      raise ValueError(f"truncated R serialization: need {n} bytes at {self.pos}, have {len(self.data)}")
    chunk = self.data[self.pos:self.pos + n]
    self.pos += n
    return chunk

  def int(self) -> int:
    return struct.unpack(">i", self._take(4))[0]

  def length(self) -> int:
    n = self.int()
    if n == -1:  # long vector: two more ints, upper and lower 32 bits
      upper, lower = self.int(), self.int()
      n = (upper << 32) + (lower & 0xFFFFFFFF)
    return n

  def read(self) -> Any:
    """Header, then the root object."""
    fmt = self._take(2)
    if fmt != b"X\n":
      raise ValueError(f"serialization format {fmt!r} is not XDR (b'X\\n')")
    version = self.int()
    self.int(), self.int()  # writer's R version, minimal reader version
    if version == 3:
      self._take(self.int())  # native encoding name
    elif version != 2:
      raise ValueError(f"R serialization {version=} is not supported (2 or 3)")
    return self.item()

  def item(self) -> Any:
    flags = self.int()
    sexptype = flags & 0xFF
    has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
    if sexptype == NILVALUE_SXP:
      return None
    if sexptype in (EMPTYENV_SXP, BASEENV_SXP, GLOBALENV_SXP):
      return f"<env {sexptype}>"
    if sexptype == REFSXP:
      index = flags >> 8 or self.int()
      return self.refs[index - 1]
    if sexptype == SYMSXP:
      name = self.item()
      self.refs.append(name)
      return name
    if sexptype in (LISTSXP, LANGSXP):
      return self._pairlist(has_attr, has_tag)
    if sexptype == CHARSXP:
      n = self.int()
      if n == -1:
        return None  # NA_character_
      encoding = "latin-1" if flags & (1 << 14) else "utf-8"  # LATIN1_MASK: bit 2 of the levels (flags >> 12)
      return self._take(n).decode(encoding)
    if sexptype in (LGLSXP, INTSXP):
      n = self.length()
      values = [None if v == NA_INTEGER else v for v in struct.unpack(f">{n}i", self._take(4 * n))]
    elif sexptype == REALSXP:
      n = self.length()
      values = list(struct.unpack(f">{n}d", self._take(8 * n)))
    elif sexptype == STRSXP:
      values = [self.item() for _ in range(self.length())]
    elif sexptype in (VECSXP, EXPRSXP):
      values = [self.item() for _ in range(self.length())]
    elif sexptype == RAWSXP:
      values = list(self._take(self.length()))
    else:
      raise ValueError(f"R SEXP type {sexptype} (flags={flags:#x}) at byte {self.pos - 4} is not supported")
    attributes = dict(self.item()) if has_attr else {}
    return RVector(sexptype, values, attributes)

  def _pairlist(self, has_attr: bool, has_tag: bool) -> RPairList:
    """Pairlists are serialized as nested (attr?, tag?, car, cdr); unroll the cdr chain iteratively."""
    out = RPairList()
    while True:
      if has_attr:
        self.item()
      tag = self.item() if has_tag else None
      out.append((tag, self.item()))
      flags = self.int()
      if flags & 0xFF == NILVALUE_SXP:
        return out
      if flags & 0xFF not in (LISTSXP, LANGSXP):
        raise ValueError(f"pairlist cdr of type {flags & 0xFF} is not supported")
      has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))


def named(vector: RVector) -> dict[str, Any]:
  """An R named list as a dict."""
  names = vector.attributes.get("names")
  if names is None:
    raise ValueError(f"{vector} has no names attribute")
  return dict(zip(names.values, vector.values))


def read_lazyload_db(data_dir: pathlib.Path) -> dict[str, RVector]:
  """Every variable of ``<data_dir>/Rdata.rdx/.rdb`` by name."""
  index = named(XdrReader(gzip.decompress((data_dir / "Rdata.rdx").read_bytes())).read())
  blob = (data_dir / "Rdata.rdb").read_bytes()
  out = {}
  for name, where in named(index["variables"]).items():
    offset, length = (int(v) for v in where.values)
    record = blob[offset:offset + length]
    expected = struct.unpack(">I", record[:4])[0]
    raw = zlib.decompress(record[4:])
    if len(raw) != expected:
      raise ValueError(f"{name}: decompressed {len(raw)} bytes, the record header says {expected}")
    out[name] = XdrReader(raw).read()
  return out


def download_package(workdir: pathlib.Path) -> pathlib.Path:
  """``apt-get download`` + ``dpkg-deb -x``; returns the extracted janeaustenr/ folder."""
  subprocess.run(["apt-get", "download", DEBIAN_PACKAGE], cwd=workdir, check=True)
  (deb,) = workdir.glob(f"{DEBIAN_PACKAGE}_*.deb")
  subprocess.run(["dpkg-deb", "-x", str(deb), str(workdir / "root")], check=True)
  print(f"downloaded {deb.name}")
  return workdir / "root/usr/lib/R/site-library/janeaustenr"


def package_version(package_dir: pathlib.Path) -> str:
  for line in (package_dir / "DESCRIPTION").read_text().splitlines():
    if line.startswith("Version:"):
      return line.split(":", 1)[1].strip()
  raise ValueError(f"no Version: line in {package_dir / 'DESCRIPTION'}")


def write_novels(package_dir: pathlib.Path, out_dir: pathlib.Path) -> dict[str, int]:
  """Writes one UTF-8 text per novel (lines joined with "\\n"); returns characters written per file."""
  objects = read_lazyload_db(package_dir / "data")
  missing = sorted(set(NOVELS) - set(objects))
  if missing:
    raise ValueError(f"janeaustenr data lacks {missing}; it has {sorted(objects)}")
  out_dir.mkdir(parents=True, exist_ok=True)
  sizes = {}
  for name, (stem, title) in NOVELS.items():
    vector = objects[name]
    if vector.sexptype != STRSXP:
      raise ValueError(f"{name} has SEXP type {vector.sexptype}, expected a character vector ({STRSXP})")
    text = "\n".join("" if line is None else line for line in vector.values).strip() + "\n"
    (out_dir / f"{stem}.txt").write_text(text, encoding="utf-8")
    sizes[f"{stem}.txt"] = len(text)
    print(f"{title:24s} {len(vector.values):6d} lines {len(text):8d} chars -> {out_dir / stem}.txt")
  return sizes


def write_source_md(out_dir: pathlib.Path, upstream: str, debian_version: str, sizes: dict[str, int]):
  rows = "\n".join(f"| `{stem}.txt` | {title} | {sizes[stem + '.txt']:,} |" for stem, title in NOVELS.values())
  (out_dir / "SOURCE.md").write_text(f"""# Jane Austen's six novels

Public-domain texts (Jane Austen, 1811-1818; transcriptions from Project Gutenberg as packaged by the
R package `janeaustenr` {upstream}, MIT-licensed packaging by Julia Silge), extracted from the Debian
package `{DEBIAN_PACKAGE}` version `{debian_version}`. One UTF-8 file per novel, the
package's lines joined with "\\n" (outer blank lines stripped, one final newline); nothing else
from the package is kept.

| file | title | characters |
|---|---|---|
{rows}

Regenerate (needs `apt-get` and `dpkg-deb`, not R), from the repository root:

    python tools/extract_austen.py
""", encoding="utf-8")


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--package-dir", type=pathlib.Path, help="an extracted janeaustenr/ R package folder")
  parser.add_argument("--debian-version", default=None, help="Debian package version, for SOURCE.md")
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("data/austen"))
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    package_dir = args.package_dir or download_package(pathlib.Path(tmp))
    debian_version = args.debian_version
    if debian_version is None and args.package_dir is None:
      (deb,) = pathlib.Path(tmp).glob(f"{DEBIAN_PACKAGE}_*.deb")
      debian_version = deb.name.split("_")[1]
    sizes = write_novels(package_dir, args.out)
    upstream = package_version(package_dir)
  write_source_md(args.out, upstream, debian_version or "unknown", sizes)
  print(f"janeaustenr {upstream}, Debian {DEBIAN_PACKAGE} {debian_version or 'unknown'}")


if __name__ == "__main__":
  main()
