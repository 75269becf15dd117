"""NIAH case builder (placement, length budget, sentence backoff, errors), scoring, grid, TFDS round trip."""
import random

import pytest
import tensorflow_datasets as tfds

from specache_jax.data import corpora, niah
from specache_jax.data import tfds_niah

SPEC = niah.NeedleSpec()
NEEDLE_WORDS = len(SPEC.needle.split())


def _haystack(seed: int, n_sentences: int = 400) -> str:
  """Random sentences of 4-12 words, each ending with ". "."""
  rng = random.Random(seed)
  words = [f"w{i}" for i in range(200)]
  return " ".join(" ".join(rng.choices(words, k=rng.randint(4, 12))) + "." for _ in range(n_sentences))


def _check_span(tok, case):
  assert 0 <= case.needle_start < case.needle_end <= len(case.prompt_ids)
  assert case.spec.needle in tok.decode(case.prompt_ids[case.needle_start:case.needle_end])
  assert list(case.prompt_ids) == tok.encode(case.prompt)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("context_tokens", [128, 700])
def test_whitespace_case_places_needle_at_depth_within_budget(seed, context_tokens):
  tok, hay = niah.WhitespaceTokenizer(), _haystack(seed)
  depths = sorted(random.Random(seed).random() for _ in range(8)) + [0.0, 1.0]
  used = []
  for depth in sorted(depths):
    case = niah.build_case(tok, hay, SPEC, context_tokens, depth)
    _check_span(tok, case)
    assert case.needle_end - case.needle_start == NEEDLE_WORDS
    assert abs(len(case.prompt_ids) - context_tokens) <= 2, (len(case.prompt_ids), context_tokens)
    # the needle follows a sentence end, or opens the context, or (depth 1, as in the original) closes it
    before = case.context[:case.context.index(SPEC.needle)]
    assert before == "" or before.endswith(". ") or case.context.endswith(SPEC.needle), before[-20:]
    assert case.context.endswith(SPEC.needle) == (depth == 1.0)
    # backoff only moves the needle earlier, by less than one sentence (<= 12 words)
    assert case.depth <= depth + 1e-9
    assert case.depth >= depth - 13 / case.haystack_tokens
    used.append(case.depth)
  assert used == sorted(used)
  assert used[0] == 0.0 and used[-1] == 1.0


def test_depth_edges_put_the_needle_first_and_last():
  tok, hay = niah.WhitespaceTokenizer(), _haystack(3)
  first = niah.build_case(tok, hay, SPEC, 200, 0.0)
  assert first.needle_start == 0 and first.context.startswith(SPEC.needle)
  last = niah.build_case(tok, hay, SPEC, 200, 1.0)
  assert last.context.endswith(SPEC.needle)
  assert last.prompt.startswith(last.context) and last.prompt.endswith("Answer:")


def test_sentence_boundary_backoff_is_exact():
  tok = niah.WhitespaceTokenizer()
  hay = " ".join(f"a{i} b{i} c{i} d{i} e{i} f{i} g{i} h{i} i{i} j{i}." for i in range(50))  # 10 words each
  overhead = len(tok.encode(niah.plain_prompt("", SPEC.question)))
  context_tokens = 100 + NEEDLE_WORDS + overhead  # haystack budget: exactly 100 words
  case = niah.build_case(tok, hay, SPEC, context_tokens, 0.35)  # target word 35 -> back off to word 30
  assert case.haystack_tokens == 100
  assert case.context.split()[:31] == hay.split()[:30] + ["The"]
  assert case.depth == pytest.approx(0.30)
  assert case.needle_start == 30
  # "Mr. " and initials are not sentence ends
  titled = " ".join(f"a{i} b{i} Mr. Knightley c{i} J. Austen d{i} e{i} f{i}." for i in range(50))  # 10 words
  case = niah.build_case(tok, titled, SPEC, context_tokens, 0.38)
  assert case.needle_start == 30 and case.context.split()[29:31] == ["f2.", "The"]
  # no ". " before the target: the needle opens the context
  one_sentence = " ".join(f"x{i}" for i in range(300))
  assert niah.build_case(tok, one_sentence, SPEC, context_tokens, 0.5).needle_start == 0


def test_char_tokenizer_on_essays_and_reserve_tokens():
  tok, hay = niah.CharTokenizer(), corpora.long_text("paul_graham")
  for depth in (0.25, 0.75):
    case = niah.build_case(tok, hay, SPEC, 3000, depth, reserve_tokens=100)
    _check_span(tok, case)
    assert case.needle_end - case.needle_start == len(SPEC.needle)
    assert abs(len(case.prompt_ids) - 2900) <= 2
    assert case.context.replace(SPEC.needle + " ", "", 1) == hay[:case.haystack_tokens]  # exact round trip


def test_formatter_hook_chatml_and_bad_formatter():
  tok, hay = niah.WhitespaceTokenizer(), _haystack(4)
  case = niah.build_case(tok, hay, SPEC, 300, 0.5, formatter=niah.chatml_prompt)
  _check_span(tok, case)
  assert case.prompt.startswith("<|im_start|>user\n") and case.prompt.endswith("<|im_start|>assistant\n")
  assert abs(len(case.prompt_ids) - 300) <= 2
  with pytest.raises(ValueError, match="must include the context verbatim"):
    niah.build_case(tok, hay, SPEC, 300, 0.5, formatter=lambda context, question: context.upper() + question)


def test_errors_name_the_value():
  tok, hay = niah.WhitespaceTokenizer(), _haystack(5, n_sentences=20)
  for depth in (-0.01, 1.5):
    with pytest.raises(ValueError, match=r"depth=.* must be in \[0, 1\]"):
      niah.build_case(tok, hay, SPEC, 100, depth)
  with pytest.raises(ValueError, match="context_tokens=30 is too short for the needle"):
    niah.build_case(tok, hay, SPEC, 30, 0.5)
  with pytest.raises(ValueError, match="the haystack has .* tokens, fewer than"):
    niah.build_case(tok, hay, SPEC, 1000, 0.5)
  with pytest.raises(ValueError, match="reserve_tokens=-1"):
    niah.build_case(tok, hay, SPEC, 100, 0.5, reserve_tokens=-1)
  with pytest.raises(ValueError, match="match='some'"):
    niah.NeedleSpec(match="some")
  with pytest.raises(ValueError, match="answer_keywords"):
    niah.NeedleSpec(answer_keywords=["sandwich"])
  with pytest.raises(ValueError, match="needle=' ' must not be blank"):
    niah.NeedleSpec(needle=" ")


def test_score_all_any_case_insensitive():
  good = "Eat a SANDWICH and sit in Dolores   park on a sunny day."
  assert niah.score(good, SPEC)
  assert not niah.score("Eat a sandwich somewhere.", SPEC)
  assert not niah.score("Go to the beach.", SPEC)
  anyspec = niah.NeedleSpec(match="any")
  assert niah.score("Eat a sandwich somewhere.", anyspec)
  assert niah.score("dolores park", anyspec)
  assert not niah.score("Go to the beach.", anyspec)


def test_grid_ids_order_and_errors():
  cells = list(niah.grid([1024, 2048], [0.0, 0.5, 0.125]))
  assert [c.id for c in cells] == ["len=1024_depth=0.00", "len=1024_depth=0.50", "len=1024_depth=0.125",
                                   "len=2048_depth=0.00", "len=2048_depth=0.50", "len=2048_depth=0.125"]
  length, depth = cells[4][1:]
  assert (length, depth) == (2048, 0.5)
  assert niah.cell_id(1024, 0.5) == "len=1024_depth=0.50"
  with pytest.raises(ValueError, match="depth=1.1 must be in"):
    list(niah.grid([1024], [1.1]))
  with pytest.raises(ValueError, match="must not repeat"):
    list(niah.grid([1024, 1024], [0.5]))
  with pytest.raises(ValueError, match="context length 0 must be a positive int"):
    list(niah.grid([0], [0.5]))


def test_tfds_builder_round_trip(tmp_path):
  ds = tfds.data_source("niah_grid/whitespace_tiny", split="test", data_dir=str(tmp_path))
  cfg = tfds_niah.NiahGrid.builder_configs["whitespace_tiny"]
  expected = {c.id: c for c in niah.grid(cfg.context_lengths, cfg.depths)}
  examples = {ex["id"].decode(): ex for ex in (ds[i] for i in range(len(ds)))}
  assert set(examples) == set(expected)
  hay = corpora.long_text("paul_graham")
  for cell_id, ex in examples.items():
    cell = expected[cell_id]
    assert ex["context_length"] == cell.context_length and ex["depth"] == pytest.approx(cell.depth)
    case = niah.build_case(niah.WhitespaceTokenizer(), hay, SPEC, cell.context_length, cell.depth)
    assert ex["prompt"].decode() == case.prompt
    assert (ex["needle_start"], ex["needle_end"]) == case.needle_span
    assert ex["depth_used"] == pytest.approx(case.depth)
    assert len(ex["prompt_ids"]) == len(case.prompt_ids)
    assert [k.decode() for k in ex["answer_keywords"]] == list(SPEC.answer_keywords)
    assert ex["needle"].decode() == SPEC.needle and ex["question"].decode() == SPEC.question


def test_tfds_builder_custom_config_with_tokenizer_object(tmp_path):
  cfg = tfds_niah.NiahGridConfig(name="chars_custom", tokenizer="my_chars", context_lengths=(400,),
                                 depths=(0.5,), haystack="austen", formatter="chatml")
  with pytest.raises(ValueError, match="tokenizer='my_chars' is not built in"):
    tfds_niah.NiahGrid(config=cfg, data_dir=str(tmp_path))
  builder = tfds_niah.NiahGrid(config=cfg, tokenizer=niah.CharTokenizer(), data_dir=str(tmp_path))
  builder.download_and_prepare()
  (ex,) = list(builder.as_data_source(split="test"))
  prompt = ex["prompt"].decode()
  assert prompt.startswith("<|im_start|>user\n") and abs(len(prompt) - 400) <= 2
  assert niah.CharTokenizer().decode(ex["prompt_ids"][ex["needle_start"]:ex["needle_end"]]) == SPEC.needle
  with pytest.raises(ValueError, match="formatter='jinja'"):
    tfds_niah.NiahGridConfig(name="bad", formatter="jinja")
