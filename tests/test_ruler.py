"""RULER: generators (determinism, budget, needle placement, answer counts), scoring, QA readers, the sweep."""
from __future__ import annotations

import collections
import glob
import json
import os
import random
import re

import pytest

from experiments.lib.models import CharTokenizer
from specache_jax.data import ruler
from specache_jax.data.ruler import aggregation, haystacks, niah, tasks

CHAR = CharTokenizer()
LENGTH = 2500                     # characters = tokens of the char tokenizer; below 4096 (cwe's short counts)
NIAH_TASKS = [t for t in ruler.SYNTHETIC if t.startswith("niah_")]


def _gen(task, length=LENGTH, index=0, seed=0, tok=CHAR, **kw):
  return ruler.generate(task, length, index, seed, tok, formatter=ruler.chat(tok), **kw)


def _count(text: str, item: str) -> int:
  """Occurrences of `item` as a whole token (not inside a longer word, number, key or UUID)."""
  return len(re.findall(r"(?<![\w-])" + re.escape(item) + r"(?![\w-])", text))


def _context(s) -> str:
  return s.prompt[s.context[0]:s.context[1]]


@pytest.fixture(scope="module")
def smollm2_tok():
  """SmolLM2's tokenizer: from the converted-model cache when there is one (fast), else from the GGUF."""
  from specache_jax.checkpoints import registry
  from specache_jax.tokenizer import Tokenizer
  cached = sorted(glob.glob(os.path.join(registry.cache_root(None), f"smollm2-135m-{registry.CACHE_VERSION}-*",
                                         "tokenizer.json")))
  if cached:
    return Tokenizer.load(os.path.dirname(cached[-1]))
  from specache_jax.checkpoints.gguf import open_reader, read_fields
  return Tokenizer.from_gguf_metadata(read_fields(open_reader(registry.registered_path("smollm2-135m"))))


# ------------------------------------------------------------------------------------------------ generators
@pytest.mark.parametrize("task", ruler.SYNTHETIC)
def test_every_generator_is_deterministic_by_seed(task):
  a, b = _gen(task, seed=3, index=1), _gen(task, seed=3, index=1)
  assert a == b
  assert _gen(task, seed=4, index=1).prompt != a.prompt
  assert _gen(task, seed=3, index=2).prompt != a.prompt
  assert a.id == f"{task}/len={LENGTH}/i=1"


@pytest.mark.parametrize("task", ruler.SYNTHETIC)
def test_prompts_fit_the_budget_and_the_haystack_is_the_largest_that_fits(task):
  s = _gen(task)
  assert list(s.prompt_ids) == CHAR.encode(s.prompt)
  assert len(s.prompt_ids) + s.gen_tokens <= LENGTH
  assert s.gen_tokens == {"vt": 30, "cwe": 120, "fwe": 50}.get(task, 128)    # RULER's budgets
  spec, coords = ruler.TASKS[task], tasks.Coords(task, LENGTH, 0, 0)
  fixed = spec.prepare(coords, CHAR, None)
  bigger = spec.draft(coords, fixed, s.size + 1)
  assert len(CHAR.encode(CHAR.chat([{"role": "user", "content": bigger.user}]) + bigger.answer_prefix)) \
      > LENGTH - s.gen_tokens
  assert s.prompt.endswith("<|im_start|>assistant\n" + s.answer_prefix)


def test_budget_with_smollm2_tokens_at_4k(smollm2_tok):
  for task in ("niah_single_2", "niah_multikey_3", "vt", "cwe", "fwe"):
    s = _gen(task, length=4096, tok=smollm2_tok)
    assert list(s.prompt_ids) == smollm2_tok.encode(s.prompt)
    used = len(s.prompt_ids) + s.gen_tokens
    assert 4096 - 60 <= used <= 4096, (task, used)


@pytest.mark.parametrize("task", NIAH_TASKS)
def test_niah_needles_sit_where_recorded_and_each_value_occurs_once(task):
  spec = ruler.TASKS[task]
  s = _gen(task, index=2)
  context = _context(s)
  assert len(s.needles) == spec.n_needles
  starts = [n.start for n in s.needles]
  assert starts == sorted(starts) and s.context[0] <= starts[0] and starts[-1] < s.context[1]
  for n in s.needles:
    assert s.prompt[n.start:n.start + len(n.text)] == n.text
    assert re.fullmatch(r"One of the special magic (numbers|uuids) for \S+ is: \S+\.", n.text)
    assert 0.0 <= n.depth <= 1.0
  pairs = [re.fullmatch(r"One of the special magic \w+ for (\S+) is: (\S+)\.", n.text).groups() for n in s.needles]
  for key, value in pairs:
    assert _count(context, value) == 1, value
    assert _count(context, key) == spec.num_v, key
  asked = [k for k, _ in pairs if _count(s.query, k)]
  assert len(set(asked)) == spec.num_q
  assert sorted(s.answers) == sorted(v for k, v in pairs if k in asked)
  assert len(s.answers) == spec.num_q * spec.num_v
  singular = spec.num_q * spec.num_v == 1
  assert ("What is the special magic" in s.prompt) == singular
  assert s.answer_prefix.endswith(" is" if singular else " are")


@pytest.mark.parametrize("task", ["niah_single_2", "niah_multikey_1", "niah_multivalue", "niah_multiquery"])
def test_essay_needles_go_at_sentence_boundaries_at_rulers_depths(task):
  spec, coords = ruler.TASKS[task], tasks.Coords(task, LENGTH, 5, 0)
  s = _gen(task, index=5)
  fixed = spec.prepare(coords, CHAR, None)
  context, c0 = _context(s), s.context[0]
  essay = context
  for n in s.needles:
    essay = essay.replace(n.text + " ", "", 1) if n.text + " " in essay else essay.replace(" " + n.text, "", 1)
  assert essay == haystacks.essay_prefix(s.size)               # the haystack is the essay prefix, untouched
  sentences = haystacks.split_sentences(essay)
  want = sorted(int(len(sentences) * d / 100) for d in fixed.depths)
  assert all(d in niah.DEPTHS for d in fixed.depths) and len(set(fixed.depths)) == len(fixed.depths)
  for n, k in zip(s.needles, want):
    before = s.prompt[c0:n.start]
    for m in s.needles:                                         # drop the other needles before this one
      before = before.replace(m.text + " ", "")
    assert (len(haystacks.split_sentences(before.strip())) if before.strip() else 0) == k
    if before:
      assert before.endswith(" ") and haystacks.split_sentences(before.strip())[-1] == sentences[k - 1]


def test_sentence_splitter_keeps_the_text_and_skips_abbreviations():
  text = "Mr. Smith went to Washington. He saw J. Edgar Hoover! Then, e.g. lunch? \"Yes.\" Done 3. Four"
  got = haystacks.split_sentences(text)
  assert " ".join(got) == text
  assert got == ["Mr. Smith went to Washington.", "He saw J. Edgar Hoover!", "Then, e.g. lunch?", "\"Yes.\"",
                 "Done 3.", "Four"]


def test_multikey_haystacks_of_distractor_needles():
  for task, value_re in (("niah_multikey_2", r"\d{7}"), ("niah_multikey_3", r"[0-9a-f-]{36}")):
    s = _gen(task)
    lines = _context(s).split("\n")
    assert len(lines) == s.size + 1
    assert all(re.fullmatch(r"One of the special magic (numbers|uuids) for \S+ is: " + value_re + r"\.", ln)
               for ln in lines)
    assert lines.count(s.needles[0].text) == 1


def test_noise_haystack_is_rulers_paragraph_one_per_line():
  s = _gen("niah_single_1")
  lines = _context(s).split("\n")
  assert lines.count(ruler.templates.NOISE) == s.size and len(lines) == s.size + 1


def test_vt_chain_in_order_answers_counted_and_one_worked_example():
  s = _gen("vt", index=4)
  names, value = s.answers, s.query
  context = _context(s)
  assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", v) for v in names)
  assert [n.text for n in s.needles] == [f"VAR {names[0]} = {value}"] + \
      [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(4)]
  for n in s.needles:
    assert s.prompt[n.start:n.start + len(n.text)] == n.text
    assert s.prompt[n.start - 1] == "\n" and s.prompt[n.start + len(n.text)] == "\n"
  assert [_count(context, v) for v in names] == [2, 2, 2, 2, 1]
  assert _count(context, value) == 1
  assert s.answer_prefix == (" Answer: According to the chain(s) of variable assignment in the text above, "
                             f"5 variables are assigned the value {value}, they are: ")
  head = s.prompt[:s.context[0]]
  assert head.count("Memorize and track the chain(s)") == 2          # the example, then the task
  example = re.search(r"they are:  ((?:[A-Z]{3} ){4}[A-Z]{3})\n\n", head)
  assert example and not set(example.group(1).split()) & set(names)
  assert set(context.split("\n")) - {n.text for n in s.needles} == {ruler.templates.NOISE}


@pytest.mark.parametrize("length,common,uncommon,example", [(LENGTH, 6, 1, (3, 1, 20)), (9000, 30, 3, (10, 3, 40))])
def test_cwe_counts(length, common, uncommon, example):
  s = _gen("cwe", length=length, index=1)
  assert len(s.prompt_ids) + 120 <= length
  items = re.split(r" ?(\d+)\. ", _context(s))[1:]
  numbers, words = [int(x) for x in items[0::2]], items[1::2]
  assert numbers == list(range(1, len(words) + 1))
  counts = collections.Counter(words)
  assert len(s.answers) == 10 and all(counts[w] == common for w in s.answers)
  assert all(n == uncommon for w, n in counts.items() if w not in s.answers)
  assert len(counts) == s.size
  head = s.prompt[:s.context[0]]
  ex_list = next(line for line in head.split("\n") if line.startswith("1. "))    # the worked example's list
  ex_items = re.split(r" ?\d+\. ", ex_list)[1:]
  ex_counts = collections.Counter(ex_items)
  assert sorted(ex_counts.values(), reverse=True)[:10] == [example[0]] * 10
  assert len(ex_counts) == example[2] and not set(ex_counts) & set(counts)


def test_fwe_zipf_counts_and_answers():
  s = _gen("fwe", index=2)
  counts = collections.Counter(_context(s).split(" "))
  z = aggregation.zeta(2.0)
  assert abs(z - 3.141592653589793 ** 2 / 6) < 1e-12
  ranked = [w for w, _ in counts.most_common()]
  assert ranked[0] == "..." and counts["..."] == int(s.size / z)
  assert tuple(ranked[1:4]) == s.answers
  for k, w in enumerate(s.answers, start=2):
    assert counts[w] == int(s.size * k ** -2.0 / z)
  assert counts[s.answers[2]] > counts[ranked[4]]
  assert len(counts) <= (LENGTH - 50) // 50 and all(re.fullmatch(r"[a-z]{6}|\.\.\.", w) for w in counts)


def test_bad_arguments_name_the_value():
  with pytest.raises(ValueError, match="not a RULER task"):
    ruler.generate("niah_single_9", 1000, 0, 0, CHAR)
  with pytest.raises(ValueError, match="does not fit length=200"):
    _gen("vt", length=200)
  with pytest.raises(ValueError, match="haystack='hay'"):
    niah.Niah("hay")


# ------------------------------------------------------------------------------------------------------- qa
def _squad_fixture(path, rng):
  words = [f"w{i}" for i in range(300)]

  def para(k):
    return " ".join(rng.choices(words, k=25)) + f" The founder of place{k} was Person{k}."

  articles = []
  for a in range(8):
    paragraphs = []
    for p in range(4):
      k = a * 4 + p
      paragraphs.append({"context": para(k), "qas": [
          {"question": f"Who founded place{k}?", "is_impossible": False,
           "answers": [{"text": f"Person{k}", "answer_start": 0}, {"text": f"Person{k}", "answer_start": 0}]},
          {"question": f"Who sold place{k}?", "is_impossible": True, "answers": []}]})
    articles.append({"title": f"A{a}", "paragraphs": paragraphs})
  path.write_text(json.dumps({"version": "v2.0", "data": articles}))


def _hotpot_fixture(path, rng):
  words = [f"v{i}" for i in range(300)]
  data = []
  for q in range(6):
    context = [[f"Title{q}_{j}", [" ".join(rng.choices(words, k=12)) + ".", f" Fact {q}.{j} is true."]]
               for j in range(10)]
    data.append({"_id": str(q), "question": f"Which fact is number {q}?", "answer": f"Fact {q}.0",
                 "type": "bridge", "level": "easy", "supporting_facts": [], "context": context})
  path.write_text(json.dumps(data))


def test_qa_1_reads_squad_and_hides_the_gold_paragraph_among_distractors(tmp_path):
  path = tmp_path / "dev-v2.0.json"
  _squad_fixture(path, random.Random(0))
  s = _gen("qa_1", index=5, data_files={"squad": str(path)})
  assert s.query == "Who founded place5?" and s.answers == ("Person5", "Person5")     # impossible ones skipped
  assert len(s.needles) == 1
  gold = s.needles[0]
  assert s.prompt[gold.start:gold.start + len(gold.text)] == gold.text and "place5 was Person5" in gold.text
  docs = re.findall(r"Document (\d+):\n", _context(s))
  assert [int(d) for d in docs] == list(range(1, s.size + 1)) and s.size > 4
  assert _context(s).count("The founder of place5 was Person5.") == 1
  assert s.metric == "part" and s.gen_tokens == 32 and s.answer_prefix == " Answer:"
  assert _gen("qa_1", index=5, data_files={"squad": str(path)}) == s


def test_qa_2_reads_hotpotqa_distractor_setting(tmp_path):
  path = tmp_path / "hotpot_dev_distractor_v1.json"
  _hotpot_fixture(path, random.Random(1))
  s = _gen("qa_2", index=3, data_files={"hotpotqa": str(path)})
  assert s.query == "Which fact is number 3?" and s.answers == ("Fact 3.0",)
  assert len(s.needles) == 10 and all(n.text.startswith("Document ") for n in s.needles)
  assert _context(s).count("Fact 3.0 is true.") == 1
  assert len(s.prompt_ids) + 32 <= LENGTH


def test_missing_qa_files_give_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"SQuAD v2\.0 dev JSON \(dev-v2\.0\.json"):
    _gen("qa_1")
  missing = tmp_path / "nope" / "hotpot_dev_distractor_v1.json"
  with pytest.raises(FileNotFoundError, match=re.escape(str(missing)) + " does not exist.*HotpotQA"):
    _gen("qa_2", data_files={"hotpotqa": str(missing)})
  bad = tmp_path / "bad.json"
  bad.write_text("[1, 2]")
  with pytest.raises(ValueError, match="is not SQuAD JSON"):
    _gen("qa_1", data_files={"squad": str(bad)})


# -------------------------------------------------------------------------------------------------- scoring
def test_string_match_all_and_part_by_hand():
  preds = ["The numbers are 123 and 456.", "nothing here", "  ABC\n"]
  refs = [["123", "456", "789"], ["x1"], ["abc"]]
  assert ruler.string_match_all(preds, refs) == 55.56            # (2/3 + 0 + 1) / 3 * 100
  assert ruler.string_match_part(preds, refs) == 66.67            # (1 + 0 + 1) / 3 * 100
  assert ruler.string_match_part(["Paris, France", "no"], [["paris", "Lyon"], ["yes"]]) == 50.0
  assert ruler.sample_score("vivo, atom", ["VIVO", "atom", "cleric", "eat"], "all") == 0.5


def test_predictions_are_cleaned_as_ruler_does():
  assert ruler.clean("\n  answer\x07 x \t") == "answer\n x"
  assert ruler.sample_score("a\tb", ["a b"], "all") == 0.0       # a tab becomes a newline
  assert ruler.sample_score(" \x00a b ", ["a b"], "part") == 1.0
  with pytest.raises(ValueError, match="metric='exact'"):
    ruler.sample_score("x", ["x"], "exact")


# ---------------------------------------------------------------------------------------------------- sweep
def test_wilson_interval_by_hand():
  from experiments.lib import ruler as sweep
  lo, hi = sweep.wilson(0.0, 10)
  assert lo == 0.0 and hi == pytest.approx(0.27754, abs=1e-5)
  lo, hi = sweep.wilson(1.0, 10)
  assert lo == pytest.approx(0.72246, abs=1e-5) and hi == 1.0
  lo, hi = sweep.wilson(0.5, 100)
  assert (lo, hi) == (pytest.approx(0.40383, abs=1e-5), pytest.approx(0.59617, abs=1e-5))


def test_summary_table_in_the_papers_layout(tmp_path):
  from experiments.lib import ruler as sweep
  from experiments.lib.store import ResultStore
  store = ResultStore(tmp_path / "r.json")
  got = {("full", "niah_single_1"): [1, 1, 0, 1], ("full", "vt"): [0.8, 0.6],
         ("specache_1bit", "niah_single_1"): [1, 0, 0, 0], ("specache_1bit", "vt"): [0.2, 0.2]}
  for (label, task), scores in got.items():
    store.put_many({sweep.cell_id(label, task, 4096, i): dict(method=label, task=task, length=4096, index=i,
                                                               score=sc, batch_seconds=1.0 + i, batch_rows=1)
                    for i, sc in enumerate(scores)}, "fp")
  table, itable, notes = sweep.summary_tables(store, ["full", "specache_1bit"], 4096, ["niah_single_1", "vt"])
  rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()]
  assert rows[0] == ["method", "S1", "VT", "avg [95% CI]", "Δ avg vs full", "samples", "seconds"]
  lo, hi = sweep.wilson(0.725, 6)
  assert rows[2] == ["full", "75.0", "70.0", f"72.5 [{100 * lo:.1f}, {100 * hi:.1f}]", "", "6", "13"]
  assert rows[3][:3] == ["specache_1bit", "25.0", "20.0"] and rows[3][4] == "-50.0"
  assert "[30, 95]" in itable                                     # Wilson(0.75, 4) = [0.301, 0.954]
  assert notes[0].startswith("- Full cache: 72.5 on average; scores 0 on no task; at least 50 on S1, VT")
  assert notes[1] == "- specache_1bit: below full on S1 -50.0, VT -50.0"


def test_the_summary_names_the_methods_that_ran_fewer_samples(tmp_path):
  from configs import ruler as ruler_cfg
  from experiments.lib import ruler as sweep
  from experiments.lib.store import ResultStore
  store = ResultStore(tmp_path / "r.json")
  for label, got in (("full", [1.0, 0.0, 0.0]), ("quest", [0.5])):
    store.put_many({sweep.cell_id(label, "vt", 4096, i): dict(method=label, task="vt", length=4096, index=i,
                                                               score=sc, batch_seconds=1.0, batch_rows=1,
                                                               answer="x", references=["x"])
                    for i, sc in enumerate(got)}, "fp")
  c = ruler_cfg.get_config("test")
  c.output_dir, c.samples = str(tmp_path), 1
  assert sweep.sample_counts(store, ["full", "quest", "h2o"]) == {"full": 3, "quest": 1}
  sweep.write_outputs(c, store, ["full", "quest"], [4096], ["vt"], "cmd", 1.0)
  summary = (tmp_path / "summary.md").read_text()
  assert "3 samples per task (quest: 1: a subset, the first samples of each task)" in summary
  assert "| quest | 50.0 | 50.0 [5.5, 94.5] | +16.7 | 1 | 1 |" in summary        # Δ: vs all 3 of full's
  assert ("- quest ran the first 1 sample(s) of 1 task(s): 50.0 on average, the full cache 100.0 on the same "
          "samples (-50.0).") in summary


@pytest.fixture(scope="module")
def tiny():
  from experiments.lib import models
  return models.load("tiny-random")


def test_the_test_variant_end_to_end_with_qa_and_rerun_reuses_every_cell(tiny, tmp_path):
  import hashlib

  import numpy as np

  from configs import ruler as ruler_cfg
  from experiments.lib import ruler as sweep
  squad = tmp_path / "dev-v2.0.json"
  _squad_fixture(squad, random.Random(2))
  c = ruler_cfg.get_config("test")
  c.output_dir, c.squad, c.tasks = str(tmp_path / "out"), str(squad), c.tasks + ",qa_1"
  res = sweep.run(c, model=tiny, log=lambda *_: None)
  tasks_run, labels = c.tasks.split(","), c.run_methods.split(",")
  assert len(tasks_run) == 12 and res.skipped == 0
  assert res.computed == len(res.records) == len(labels) * len(tasks_run) * c.samples
  n = int(c.lengths)
  for task in tasks_run:
    s = ruler.generate(task, n, 0, c.seed, tiny.tokenizer, formatter=ruler.chat(tiny.tokenizer),
                       data_files={"squad": str(squad)})
    for label in labels:
      rec = res.records[sweep.cell_id(label, task, n, 0)]
      assert rec["prompt_sha"] == hashlib.sha256(np.asarray(s.prompt_ids, np.int32).tobytes()).hexdigest()[:16]
      assert rec["references"] == list(s.answers) and rec["gen_tokens"] == 4
      assert rec["score"] == ruler.sample_score(rec["answer"], s.answers, s.metric)
  summary = (tmp_path / "out" / "summary.md").read_text()
  assert "| method | S1 | S2 | S3 | MK1 | MK2 | MK3 | MV | MQ | VT | CWE | FWE | QA1 | avg [95% CI] |" in summary
  assert (tmp_path / "out" / "heatmap.png").stat().st_size > 0
  again = sweep.run(c, model=tiny, log=lambda *_: None)
  assert again.computed == 0 and again.skipped == res.computed and again.table == res.table


def test_sweep_refuses_a_missing_qa_file_before_loading_a_model(tmp_path):
  from configs import ruler as ruler_cfg
  from experiments.lib import ruler as sweep
  from specache_jax.errors import ConfigError
  c = ruler_cfg.get_config("test")
  c.output_dir, c.tasks, c.model = str(tmp_path), "vt,qa_2", "/nonexistent/model"
  with pytest.raises(ConfigError, match=r"hotpot_dev_distractor_v1\.json"):
    sweep.run(c, log=lambda *_: None)
  c.tasks = "vt,niah_single_4"
  with pytest.raises(ConfigError, match="niah_single_4"):
    sweep.run(c, log=lambda *_: None)


# ----------------------------------------------------------------------------------------------------- tfds
def test_tfds_builder_writes_the_generated_split(tmp_path):
  import tensorflow_datasets as tfds

  from specache_jax.data import niah as niah_data
  from specache_jax.data.ruler import tfds_ruler
  builder = tfds_ruler.Ruler(config="chars_tiny", data_dir=str(tmp_path))
  builder.download_and_prepare()
  ds = tfds.data_source("ruler/chars_tiny", split="test", data_dir=str(tmp_path))
  cfg = builder.builder_config
  assert len(ds) == len(cfg.tasks) * cfg.samples
  by_id = {ex["id"] if isinstance(ex["id"], str) else ex["id"].decode(): ex for ex in ds}
  tok = niah_data.CharTokenizer()
  for task in cfg.tasks:
    s = ruler.generate(task, 2048, 1, cfg.seed, tok, formatter=tfds_ruler.chatml)
    ex = by_id[s.id]
    text = lambda v: v if isinstance(v, str) else v.decode()
    assert text(ex["prompt"]) == s.prompt and list(ex["prompt_ids"]) == list(s.prompt_ids)
    assert [text(a) for a in ex["answers"]] == list(s.answers) and int(ex["gen_tokens"]) == s.gen_tokens
    assert list(ex["needle_starts"]) == [x.start for x in s.needles]
  with pytest.raises(ValueError, match="not built in"):
    tfds_ruler.Ruler(config=tfds_ruler.RulerConfig(name="x", tokenizer="smollm2"), data_dir=str(tmp_path))
