"""Chat templates from the checkpoint: each family's real template renders exactly as transformers'
`apply_chat_template(..., tokenize=False)` on the same tokenizer directory; refusals carry the template's own
message; the environment's helpers; no template without an explicit one; NIAH and RULER prompts end to end on a
tiny random checkpoint with Llama 2's template."""
from __future__ import annotations

import json
import os

import pytest

from specache_jax import chat_template as chat_lib
from specache_jax.tokenizer import Tokenizer
import chat_fixtures as cf

CONVERSATIONS = {
    "one_user": [{"role": "user", "content": "Hi!"}],
    "system_multi_turn": [{"role": "system", "content": "Short answers. "}, {"role": "user", "content": " 2+2? "},
                          {"role": "assistant", "content": "4 "}, {"role": "user", "content": "3+3?"}],
    "multi_turn": [{"role": "user", "content": "a\n"}, {"role": "assistant", "content": "  b"},
                   {"role": "user", "content": "What is <b>c</b> & \"d\"?"}],
    "system_user": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why?"}],
}


@pytest.fixture(scope="module")
def transformers():
  return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp("families")
  return {f: cf.write_tokenizer(f, str(root / f)) for f in cf.FAMILIES}


def _outcome(fn):
  """The text, or ("raises", message) when rendering raises."""
  try:
    return fn()
  except Exception as err:  # noqa: BLE001 (compared across the two implementations)
    return "raises", str(err).rsplit(": ", 1)[-1]


@pytest.mark.parametrize("family", sorted(cf.FAMILIES))
def test_every_family_renders_as_transformers_does(family, family_dirs, transformers):
  ours = Tokenizer.from_hf_dir(family_dirs[family])
  ref = transformers.AutoTokenizer.from_pretrained(family_dirs[family])
  assert ours.chat_template == cf.FAMILIES[family][0] == ref.chat_template
  rendered = 0
  for name, msgs in CONVERSATIONS.items():
    for gen in (True, False):
      want = _outcome(lambda: ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen))
      got = _outcome(lambda: ours.chat(msgs, add_generation_prompt=gen))
      assert got == want, (family, name, gen)
      rendered += isinstance(want, str)
      if isinstance(want, str):   # the ids too: BOS once, where the model wants it
        assert ours.encode(got) == ref(got, add_special_tokens=False)["input_ids"] or (
            ours.add_bos and ours.encode(got) == [ours.bos_token_id] + ref(got, add_special_tokens=False)["input_ids"])
  assert rendered >= 4


@pytest.mark.parametrize("family, message", [("mistral", "Conversation roles must alternate"),
                                             ("gemma", "System role not supported")])
def test_a_template_that_refuses_names_its_own_message(family, message, family_dirs):
  tok = Tokenizer.from_hf_dir(family_dirs[family])
  with pytest.raises(chat_lib.ChatTemplateError, match=f"chat template refused .*: {message}"):
    tok.chat(CONVERSATIONS["system_user"])
  with pytest.raises(ValueError, match="Conversation roles must alternate"):   # a ChatTemplateError is one
    tok.chat([{"role": "assistant", "content": "first"}])
  assert tok.chat(CONVERSATIONS["one_user"]).endswith(("[/INST]", "<start_of_turn>model\n"))


def test_llama2_folds_the_system_prompt_into_the_first_turn(family_dirs):
  tok = Tokenizer.from_hf_dir(family_dirs["llama2"])
  text = tok.chat(CONVERSATIONS["system_multi_turn"])
  assert text == "<s>[INST] <<SYS>>\nShort answers. \n<</SYS>>\n\n 2+2? [/INST] 4 </s><s>[INST] 3+3? [/INST]"
  ids = tok.encode(text)
  assert ids[0] == tok.bos_token_id == 1 and ids.count(1) == 2 and ids.count(2) == 1   # BOS never doubled


FEATURES = (
    "{%- set ns = namespace(n=0, seen=[]) -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' %}{% continue %}{% endif -%}"
    "{%- set ns.n = ns.n + 1 -%}"
    "{%- if ns.n > 2 %}{% break %}{% endif -%}"
    "{% generation %}{{ m | tojson }}{% endgeneration %}|"
    "{%- endfor %}\n"
    "    {% if add_generation_prompt %}\n"
    "      GEN {{ bos_token ~ '/' ~ eos_token ~ '/' ~ (pad_token is defined) }}\n"
    "    {% endif %}\n"
    "{{ dict(a=1, b=[1, 2]) | tojson(indent=2, sort_keys=True) }} {{ dict.fromkeys(['x'], 0) | tojson }}"
    " {{ strftime_now('%Y') | length }} {{ ns.n }}"
)


def test_the_environment_matches_transformers_helpers(tmp_path, transformers):
  """Loop controls, namespace, generation blocks, tojson (no HTML escaping, unicode kept, indent),
  dict, strftime_now, trim/lstrip blocks and the special tokens, against transformers' own renderer."""
  cf.write_tokenizer("llama2", str(tmp_path), template=FEATURES)
  ours = Tokenizer.from_hf_dir(str(tmp_path))
  ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "<b>é & \"q\"</b>", "name": None},
          {"role": "assistant", "content": "日本"}, {"role": "user", "content": "never"}]
  for gen in (True, False):
    text = ours.chat(msgs, add_generation_prompt=gen)
    assert text == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
  assert '"content": "<b>é & \\"q\\"</b>"' in text and "name" not in text and "日本" in text
  assert "never" not in text and text.endswith('\n}} {"x": 0} 4 3'.replace("}}", "}"))
  assert '"日本"}|      GEN <s>/</s>/False\n{\n  "a": 1,' in ours.chat(msgs)


@pytest.mark.parametrize("template, message", [
    ("{{ ''.__class__.__mro__ }}", "failed on .*__class__"),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", "failed on .*SecurityError: .*underscore"),
    ("{% set d = {} %}{{ d.update({'a': 1}) }}", "failed on .*SecurityError: .*unsafe"),
    ("{{ messages[5].content }}", "failed on .*UndefinedError: list object has no element 5"),
])
def test_the_sandbox_refuses_what_transformers_refuses(template, message, family_dirs, transformers):
  tok = Tokenizer.from_hf_dir(family_dirs["llama2"])
  with pytest.raises(chat_lib.ChatTemplateError, match=message):
    tok.chat(CONVERSATIONS["one_user"], chat_template=template)
  ref = transformers.AutoTokenizer.from_pretrained(family_dirs["llama2"])
  with pytest.raises(Exception, match=message.rsplit(": ", 1)[-1].rsplit(".*", 1)[-1]):
    ref.apply_chat_template(CONVERSATIONS["one_user"], tokenize=False, chat_template=template)


def test_bad_templates_and_messages_are_refused_with_the_value():
  with pytest.raises(chat_lib.ChatTemplateError, match="does not parse"):
    chat_lib.render("{% if %}", [{"role": "user", "content": "x"}])
  with pytest.raises(ValueError, match="'role' and 'content'"):
    chat_lib.render(cf.QWEN2, [{"content": "no role"}])
  with pytest.raises(ValueError, match="at least one message"):
    chat_lib.render(cf.QWEN2, [])
  with pytest.raises(ValueError, match="chat_template=''"):
    Tokenizer(cf.char_backend(["<s>"]), chat_template="")
  with pytest.raises(ValueError, match=r"\['eot_token'\]"):
    Tokenizer(cf.char_backend(["<s>"]), special_tokens={"eot_token": "<s>"})


def test_no_template_is_refused_unless_one_is_given(tmp_path):
  cf.write_tokenizer("llama2", str(tmp_path), template=None)
  tok = Tokenizer.from_hf_dir(str(tmp_path))
  assert tok.chat_template is None
  with pytest.raises(ValueError, match="no chat template .* pass one as chat"):
    tok.chat(CONVERSATIONS["one_user"])
  assert tok.chat(CONVERSATIONS["one_user"], chat_template=cf.LLAMA2) == "<s>[INST] Hi! [/INST]"
  given = Tokenizer.from_hf_dir(str(tmp_path), chat_template=cf.MISTRAL)
  assert given.chat_template == cf.MISTRAL and given.chat(CONVERSATIONS["one_user"]) == "<s>[INST] Hi! [/INST]"


def test_chat_template_jinja_and_named_templates(tmp_path):
  cf.write_tokenizer("qwen2", str(tmp_path))
  conf_path = tmp_path / "tokenizer_config.json"
  conf = json.loads(conf_path.read_text())
  conf["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": cf.SMOLLM2}]
  conf_path.write_text(json.dumps(conf))
  assert Tokenizer.from_hf_dir(str(tmp_path)).chat_template == cf.SMOLLM2
  (tmp_path / "chat_template.jinja").write_text(cf.QWEN2, encoding="utf-8")   # preferred, as in transformers
  assert Tokenizer.from_hf_dir(str(tmp_path)).chat_template == cf.QWEN2


def test_special_tokens_from_config_ids_and_gguf():
  backend = cf.char_backend(["<unk>", "<s>", "</s>"])
  tok = Tokenizer(backend, bos_token_id=1, eos_token_ids=[2], chat_template=cf.LLAMA2)
  assert tok.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
  tokens = ["<unk>", "<s>", "</s>", "a"]
  fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": [],
            "tokenizer.ggml.token_type": [3, 3, 3, 1], "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.chat_template": cf.LLAMA2}
  gguf_tok = Tokenizer.from_gguf_metadata(fields)
  assert gguf_tok.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
  assert gguf_tok.chat(CONVERSATIONS["multi_turn"]).startswith("<s>[INST] a [/INST] b </s><s>[INST] What")
  assert Tokenizer.from_gguf_metadata(fields, chat_template=cf.QWEN2).chat_template == cf.QWEN2


def test_template_and_special_tokens_survive_save_and_load(family_dirs, tmp_path):
  tok = Tokenizer.from_hf_dir(family_dirs["gemma"])
  tok.save(str(tmp_path))
  back = Tokenizer.load(str(tmp_path))
  assert back.settings() == tok.settings() and back.special_tokens["pad_token"] == "<pad>"
  assert back.chat(CONVERSATIONS["multi_turn"]) == tok.chat(CONVERSATIONS["multi_turn"])
  old = dict(tok.settings(), chat_format="chatml", default_system=None)   # written before chat templates
  del old["chat_template"], old["special_tokens"]
  (tmp_path / "tokenizer_settings.json").write_text(json.dumps(old))
  legacy = Tokenizer.load(str(tmp_path))
  assert legacy.chat_template is None and legacy.encode("hi") == tok.encode("hi")


# ------------------------------------------------------------------ NIAH and RULER with a Llama-2-style model
@pytest.fixture(scope="module")
def llama2_model(tmp_path_factory):
  """A tiny random Llama (rope theta 1e4, 128-entry vocabulary) with Llama 2's tokenizer conventions and chat
  template, loaded through specache_jax.load_model like any HF checkpoint."""
  pytest.importorskip("transformers")
  from specache_jax.checkpoints import registry
  import hf_fixtures
  path = str(tmp_path_factory.mktemp("llama2_chat"))
  hf_fixtures.write_checkpoint("tied", path)
  with open(os.path.join(path, "config.json")) as f:
    cfg = json.load(f)
  cfg["max_position_embeddings"] = 4096
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg, f)
  cf.write_tokenizer("llama2", path)
  return registry.load_model(path, cache_dir=str(tmp_path_factory.mktemp("cache")))


def test_llama2_checkpoint_loads_its_template(llama2_model):
  tok = llama2_model.tokenizer
  assert tok.chat_template == cf.LLAMA2 and tok.add_bos and tok.bos_token_id == 1
  assert llama2_model.config.eos_token_ids == (2,) and tok.vocab_size <= llama2_model.config.vocab_size


def test_niah_runs_with_a_llama2_template(llama2_model, tmp_path):
  from configs import niah as niah_cfg
  from experiments.lib import niah
  c = niah_cfg.get_config("test")
  c.lengths, c.depths, c.run_methods, c.max_new_tokens, c.output_dir = "324", "0.0,0.5", "full", 3, str(tmp_path)
  tok = llama2_model.tokenizer
  cases = niah.build_cases(c, tok, [324], [0.0, 0.5])
  for case in cases.values():
    text = tok.decode(case.prompt_ids, skip_special_tokens=False)
    assert text.startswith("<s>[INST] ") and text.endswith(" Answer briefly from the text above. [/INST]")
    assert case.prompt_ids.count(1) == 1 and max(case.prompt_ids) < llama2_model.config.vocab_size
    assert tok.decode(case.prompt_ids[slice(*case.needle_span)]).strip().startswith(c.needle.strip()[:20])
    assert abs(len(case.prompt_ids) - 324) <= 8
  res = niah.run(c, model=llama2_model, log=lambda *_: None)
  assert res.computed == 2 and all(isinstance(r["correct"], bool) for r in res.records.values())


def test_ruler_runs_with_a_llama2_template(llama2_model, tmp_path):
  from configs import ruler as ruler_cfg
  from specache_jax.data import ruler
  from experiments.lib import ruler as sweep
  c = ruler_cfg.get_config("test")
  c.tasks, c.run_methods, c.output_dir = "niah_single_1,vt", "full", str(tmp_path)
  tok = llama2_model.tokenizer
  for task in c.tasks.split(","):
    s = ruler.generate(task, int(c.lengths), 0, c.seed, tok, formatter=ruler.chat(tok))
    assert s.prompt.startswith("<s>[INST] ") and s.prompt.endswith(" [/INST]" + s.answer_prefix)
    assert s.prompt_ids[0] == 1 and s.prompt_ids.count(1) == 1
    assert len(s.prompt_ids) + s.gen_tokens <= int(c.lengths)
    for needle in s.needles:
      assert s.prompt[needle.start:needle.start + len(needle.text)] == needle.text
  res = sweep.run(c, model=llama2_model, log=lambda *_: None)
  assert res.computed == 2 and res.skipped == 0
