"""LongBench data path: jsonl reading, prompts + middle truncation, official metrics (hand-computed), the
scorer on fixture files, the paper table, and the TFDS builder read back through tfds.data_source."""
import json
import pathlib
import shutil

import pytest

from specache_jax.data import longbench as lb
from specache_jax.data import longbench_metrics as lm

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "longbench"
FIXTURE_TASKS = ("qasper", "multifieldqa_zh", "gov_report", "trec", "passage_retrieval_en", "lcc", "repobench-p")
TREC_CLASSES = ("City", "Country", "Individual", "Distance")


# ---------------------------------------------------------------- metrics, by hand
def test_qa_f1_by_hand():
  # normalize: "the cat sat" -> "cat sat" (2 tokens); "a cat sat down" -> "cat sat down" (3 tokens).
  # overlap 2: precision 2/2 = 1, recall 2/3, F1 = 2·1·(2/3) / (1 + 2/3) = (4/3)/(5/3) = 0.8
  assert lm.qa_f1_score("the cat sat", "a cat sat down") == pytest.approx(0.8)
  assert lm.normalize_answer("The Cat, an  apple!") == "cat apple"
  assert lm.qa_f1_score("dog", "cat") == 0.0
  # repeated tokens count as a multiset: "no no" vs "no": overlap 1, P = 1/2, R = 1, F1 = 1/(3/2) = 2/3
  assert lm.qa_f1_score("no no", "no") == pytest.approx(2 / 3)


def test_qa_f1_zh_by_hand():
  # jieba: 我爱北京 -> [我, 爱, 北京]; 北京 -> [北京]. overlap 1: P = 1/3, R = 1, F1 = (2/3)/(4/3) = 0.5
  assert lm.qa_f1_zh_score("我爱北京", "北京") == pytest.approx(0.5)
  # 北京。 -> [北京, 。]; 。 normalises to '' and is dropped -> [北京] vs [北京] = 1
  assert lm.qa_f1_zh_score("北京。", "北京") == pytest.approx(1.0)


def test_rouge_l_by_hand():
  # One sentence each; LCS("the brown fox sleeps", "the quick brown fox jumps") = "the brown fox" = 3.
  # R = 3/5, P = 3/4, F = 2PR/(P+R) = 0.9/1.35 = 2/3 (the package adds 1e-8 to the denominator).
  assert lm.rouge_score("the brown fox sleeps", "the quick brown fox jumps") == pytest.approx(2 / 3, abs=1e-6)
  # The `rouge` package counts unique words: "fox fox fox" has n = 1, so P = R = 1.
  assert lm.rouge_score("fox fox fox", "fox") == pytest.approx(1.0, abs=1e-6)
  assert lm.rouge_score("", "a reference") == 0.0  # the package raises on empty text; official maps it to 0
  # zh: 我 爱 北京 vs 我 爱 北京 天安门: LCS 3, P = 3/3, R = 3/4, F = 1.5/1.75 = 6/7
  assert lm.rouge_zh_score("我爱北京", "我爱北京天安门") == pytest.approx(6 / 7, abs=1e-6)


def test_classification_with_all_classes():
  assert lm.classification_score("City", "City", all_classes=TREC_CLASSES) == 1.0
  # two class names found, the true one among them -> 1/2
  assert lm.classification_score("City or Country", "City", all_classes=TREC_CLASSES) == 0.5
  assert lm.classification_score("Distance", "City", all_classes=TREC_CLASSES) == 0.0
  # no class named: the official fallback never runs -> 0
  assert lm.classification_score("a town", "City", all_classes=TREC_CLASSES) == 0.0
  # official loop quirk: matches [a, ab, abc]; 'a' (substring of the truth) is removed, which shifts 'ab' into
  # its slot so 'ab' is never checked; 'abc' is the truth. Left [ab, abc] -> 1/2 (a clean filter would give 1).
  assert lm.classification_score("abc", "abc", all_classes=["a", "ab", "abc", "x"]) == 0.5
  with pytest.raises(ValueError, match="all_classes"):
    lm.classification_score("City", "City", all_classes=None)


def test_retrieval_and_count():
  assert lm.retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
  # numbers [3, 1]: one of two is right -> 0.5
  assert lm.retrieval_score("Paragraph 3 or Paragraph 1", "Paragraph 3") == 0.5
  assert lm.retrieval_score("The answer is 30", "Paragraph 3") == 0.0  # '30' is not '3'
  assert lm.retrieval_score("I do not know", "Paragraph 3") == 0.0
  assert lm.retrieval_zh_score("答案是段落2", "段落2") == 1.0
  # numbers [12, 13], truth 12 -> 0.5
  assert lm.count_score("There are 12 unique paragraphs, not 13", 12) == 0.5
  with pytest.raises(ValueError, match="does not name a paragraph"):
    lm.retrieval_score("Paragraph 3", "3")


def test_code_sim_first_code_line():
  # fences and comments are skipped; the first plain line is compared: identical -> 100/100
  assert lm.code_sim_score("\n```python\n# add them\nreturn x + y\n```", "return x + y") == 1.0
  # "return x - y" vs "return x + y": 11 matching chars of 12 + 12 -> ratio 22/24 = 0.9167 -> fuzz 92 -> 0.92
  assert lm.code_sim_score("return x - y", "return x + y") == pytest.approx(0.92)
  assert lm.code_sim_score("// only a comment", "return x") == 0.0  # no code line -> '' -> 0


def test_first_line_truncation_only_for_few_shot_tasks():
  rambling = "\nCity\nQuestion: Who painted it?\nType: Individual"
  # trec keeps "City" only -> 1.0; without the cut both City and Individual match -> 1/2
  assert lm.example_score("trec", rambling, ["City"], TREC_CLASSES) == 1.0
  assert lm.classification_score(rambling, "City", all_classes=TREC_CLASSES) == 0.5
  assert lm.example_score("triviaqa", "\nParis\nQuestion: capital of Peru?\nAnswer: Lima", ["Paris"], None) == 1.0
  # hotpotqa is not cut: "paris lima" vs "paris": P = 1/2, R = 1, F1 = 2/3
  assert lm.example_score("hotpotqa", "Paris\nLima", ["Paris"], None) == pytest.approx(2 / 3)
  # LongBench-E names score like their base task
  assert lm.example_score("trec_e", rambling, ["City"], TREC_CLASSES) == 1.0


def test_max_over_references():
  # "four" vs ["4 layers", "four"]: 0 and 1 -> 1
  assert lm.example_score("qasper", "four", ["4 layers", "four"], None) == 1.0
  with pytest.raises(TypeError, match="list of reference strings"):
    lm.example_score("qasper", "four", "four", None)


# ---------------------------------------------------------------- scorer over fixture files
@pytest.mark.parametrize("task,predictions,expected", [
    # qasper: 1 ("Penn Treebank"), 1 ("No." -> "no"), max(0, F1("answer is four", "four") = 2·(1/3)/(4/3) = .5)
    # -> 100·2.5/3 = 83.33
    ("qasper", ["Penn Treebank", "No.", "The answer is four"], 83.33),
    # multifieldqa_zh: 1; [我,爱,北京] vs [北京,天安门]: P 1/3, R 1/2, F1 = (1/3)/(5/6) = 0.4 -> 100·1.4/2 = 70
    ("multifieldqa_zh", ["北京", "我爱北京"], 70.0),
    # gov_report: 2/3 (see test_rouge_l_by_hand) and 0 (empty) -> 100·(2/3)/2 = 33.33
    ("gov_report", ["the brown fox sleeps", ""], 33.33),
    # trec: first line "City" -> 1; "Individual or City" -> 1/2 -> 75
    ("trec", ["City\nQuestion: Who is he?\nType: Individual", "Individual or City"], 75.0),
    # passage_retrieval_en: 1 and 0 -> 50
    ("passage_retrieval_en", ["Paragraph 3", "Paragraph 1"], 50.0),
    # lcc: 1.0 and fuzz("return x - y", "return x * y") = 92 -> 100·1.92/2 = 96
    ("lcc", ["return x + y", "# mul\nreturn x - y"], 96.0),
])
def test_scorer_on_fixture_file(task, predictions, expected):
  examples = lb.read_jsonl_dir(FIXTURES, datasets=[task])[task]
  answers = [list(ex.answers) for ex in examples]
  assert lb.scorer(task, predictions, answers, examples[0].all_classes) == expected


def test_scorer_validates():
  with pytest.raises(ValueError, match="len"):
    lb.scorer("qasper", ["a"], [["a"], ["b"]], None)
  with pytest.raises(ValueError, match="not a LongBench task"):
    lb.scorer("squad", ["a"], [["a"]], None)


def test_scorer_e_length_buckets():
  # lengths 100 and 3999 -> 0-4k (scores 1, 0 -> 50); 4000 -> 4-8k (1 -> 100); 8k+ empty -> NaN
  out = lm.scorer_e("qasper", ["yes", "no", "yes"], [["yes"], ["yes"], ["yes"]], [100, 3999, 4000], None)
  assert out["0-4k"] == 50.0 and out["4-8k"] == 100.0
  assert out["8k+"] != out["8k+"]


# ---------------------------------------------------------------- prompts
def _char_tokenizer(bos=0):
  encode = lambda s: [bos] + [ord(c) for c in s]
  decode = lambda ids: "".join(chr(i) for i in ids if i != bos)
  return encode, decode


def test_truncate_middle_keeps_head_and_tail():
  head, tail = lb.truncate_middle(list(range(10)), 4)
  assert (list(head), list(tail)) == ([0, 1], [8, 9])
  head, tail = lb.truncate_middle(list(range(10)), 5)  # odd budget: 5 // 2 = 2 at each end
  assert (list(head), list(tail)) == ([0, 1], [8, 9])
  head, tail = lb.truncate_middle(list(range(3)), 4)
  assert (list(head), list(tail)) == ([0, 1, 2], [])
  with pytest.raises(ValueError, match="max_tokens=1"):
    lb.truncate_middle([1, 2, 3], 1)


def test_build_prompt_middle_truncation():
  ex = lb.read_jsonl_dir(FIXTURES, datasets=["qasper"])["qasper"][0]
  ex = lb.Example(**{**ex.__dict__, "context": "HEAD " + "filler " * 500 + " TAIL"})
  encode, decode = _char_tokenizer()
  full = lb.format_prompt("qasper", ex)
  assert full.startswith("You are given a scientific article") and full.endswith("\n\nAnswer:")
  assert lb.build_prompt("qasper", ex, encode, decode, len(full) + 1) == full  # fits with BOS: unchanged
  out = lb.build_prompt("qasper", ex, encode, decode, 300)
  # ids = [BOS] + chars; head = ids[:150] = BOS + 149 chars, tail = the last 150 chars; BOS is not decoded
  assert out == full[:149] + full[-150:]
  assert "filler filler" not in out[200:] and ex.input in out and "HEAD" not in out


def test_templates_and_lengths_cover_every_task():
  assert set(lb.DATASET2PROMPT) == set(lb.DATASET2MAXLEN) == set(lm.DATASET2METRIC) == set(lb.DATASETS)
  assert len(lb.DATASETS) == 21 and len(lb.PAPER_TASKS) == 15
  assert all(d in lb.DATASETS for d, _ in lb.PAPER_TASKS)
  assert lb.max_new_tokens("gov_report_e") == 512 and lb.max_new_tokens("passage_retrieval_en") == 32
  assert not lb.uses_chat_template("lcc") and not lb.uses_chat_template("samsum_e")
  assert lb.uses_chat_template("qasper")
  ex = lb.Example("Q?", "C {with braces}", ("a",), 3, "repobench-p", "en", None, "x")
  assert lb.format_prompt("repobench-p", ex) == (
      "Please complete the code given below. \nC {with braces}Q?Next line of code:\n")


# ---------------------------------------------------------------- table
_PAPER_FULL = [21.7, 44.3, 44.4, 46.6, 37.0, 21.5, 30.0, 22.6, 27.7, 74.5, 90.6, 42.7, 67.0, 57.1, 51.4]
_PAPER_2BIT = [20.9, 43.7, 45.1, 46.4, 37.0, 21.0, 29.7, 22.7, 27.7, 74.5, 90.1, 41.9, 67.0, 57.0, 50.4]


def test_format_table_paper_rows():
  ids = [d for d, _ in lb.PAPER_TASKS]
  table = lb.format_table({"full": dict(zip(ids, _PAPER_FULL)), "specache-2bit": dict(zip(ids, _PAPER_2BIT)),
                           "partial": {"qasper": 40.0, "lcc": 60.0}})
  lines = table.splitlines()
  assert lines[0].startswith("| Method | NrtvQA | Qasper | MF-en | HotpotQA |")
  assert lines[0].endswith("| LCC | RepoBench-P | Avg |")
  # 679.1 / 15 = 45.27 (paper: 45.3); 675.1 / 15 = 45.01 (paper: 45.0)
  assert lines[2].startswith("| full | 21.70 | 44.30 |") and lines[2].endswith("| 45.27 |")
  assert lines[3].endswith("| 45.01 |")
  # partial row: (40 + 60) / 2 = 50, marked, missing tasks shown as '-'
  assert lines[4].endswith("| 50.00* |") and "| - |" in lines[4]
  assert "average over the tasks present only" in table


# ---------------------------------------------------------------- reading and errors
def test_read_jsonl_dir_all_and_limit():
  data = lb.read_jsonl_dir(FIXTURES)
  assert set(data) == set(FIXTURE_TASKS)
  assert [ex.id for ex in data["qasper"]] == ["qasper-000", "qasper-001", "qasper-002"]
  assert data["trec"][0].all_classes == TREC_CLASSES and data["qasper"][0].all_classes is None
  assert data["qasper"][0].answers == ("Penn Treebank", "the Penn Treebank corpus")
  assert {k: len(v) for k, v in lb.read_jsonl_dir(FIXTURES, limit=1).items()} == {t: 1 for t in FIXTURE_TASKS}


def test_read_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist.*<dataset>.jsonl"):
    lb.read_jsonl_dir(tmp_path / "nope")
  with pytest.raises(FileNotFoundError, match="no LongBench task file"):
    lb.read_jsonl_dir(tmp_path)
  with pytest.raises(FileNotFoundError, match=r"narrativeqa\.jsonl is missing.*official LongBench layout"):
    lb.read_jsonl_dir(FIXTURES, datasets=["narrativeqa"])
  with pytest.raises(ValueError, match="not a LongBench task"):
    lb.read_jsonl_dir(FIXTURES, datasets=["squad"])
  good = (FIXTURES / "qasper.jsonl").read_text(encoding="utf-8").splitlines()
  (tmp_path / "qasper.jsonl").write_text(good[0] + "\n{\"input\": oops\n", encoding="utf-8")
  with pytest.raises(ValueError, match=r"qasper\.jsonl:2: malformed JSON"):
    lb.read_jsonl_dir(tmp_path, datasets=["qasper"])
  record = json.loads(good[0])
  del record["answers"], record["_id"]
  (tmp_path / "qasper.jsonl").write_text(json.dumps(record) + "\n", encoding="utf-8")
  with pytest.raises(ValueError, match=r"qasper\.jsonl:1: missing field\(s\) \['answers', '_id'\]"):
    lb.read_jsonl_dir(tmp_path, datasets=["qasper"])
  record = json.loads(good[0]) | {"answers": "Penn Treebank"}
  (tmp_path / "qasper.jsonl").write_text(json.dumps(record) + "\n", encoding="utf-8")
  with pytest.raises(ValueError, match="answers='Penn Treebank' must be a list of strings"):
    lb.read_jsonl_dir(tmp_path, datasets=["qasper"])


# ---------------------------------------------------------------- TFDS builder
def test_tfds_builder_roundtrip(tmp_path):
  tfds = pytest.importorskip("tensorflow_datasets")
  from specache_jax.data import tfds_longbench as tl
  expected = lb.read_jsonl_dir(FIXTURES)
  for task in ("qasper", "trec", "repobench-p", "multifieldqa_zh"):
    source = tl.load_data_source(task, FIXTURES, tmp_path / "tfds")
    assert [tl.example_from_record(r) for r in source] == expected[task]
  # the manual_dir route (no builder kwarg), from a copy of the jsonl directory
  manual = tmp_path / "manual"
  shutil.copytree(FIXTURES, manual)
  source = tfds.data_source(
      "longbench/lcc", split="test", data_dir=str(tmp_path / "tfds_manual"),
      download_and_prepare_kwargs={"download_config": tfds.download.DownloadConfig(manual_dir=str(manual))})
  assert [tl.example_from_record(r) for r in source] == expected["lcc"]
  assert tl.config_name("repobench-p") == "repobench_p"
