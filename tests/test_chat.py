"""Conversation corpora, chat templates (qeval.inputs.chat) and `qeval template` (qeval.orchestrate.templates)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import tinymodels
from conftest import assert_cli_error, run_cli

from qeval.engine.engine import LlamaModel
from qeval.errors import QevalError
from qeval.inputs import chat
from qeval.orchestrate import templates

SUITE = chat.shipped_dir()
JINJA = SUITE / "gemma3-chat-template.jinja"
CONFIG = SUITE / "gemma3-tokenizer_config.json"


@pytest.fixture(scope="module")
def suite() -> list[chat.Conversation]:
    return chat.load_conversations("conversations")


def assistant_texts(conversation: chat.Conversation, thinking: bool) -> list[str]:
    out = []
    for m in conversation.messages:
        if m["role"] != "assistant":
            continue
        if thinking and m.get("reasoning_content"):
            out.append(m["reasoning_content"].strip())
        if m.get("content"):
            out.append(m["content"].strip())
        out += [c["function"]["arguments"] for c in m.get("tool_calls") or ()]
    return out


def test_the_shipped_suite_covers_what_users_run(suite):
    """At least 40 conversations: chat, thinking, tool calls with JSON arguments, code, math, two other languages."""
    assert len(suite) >= 40
    categories = {c.category for c in suite}
    assert {"chat", "thinking", "tool_calls", "code", "math", "multilingual"} <= categories
    rows = [json.loads(line) for f in sorted(SUITE.glob("*.jsonl")) for line in f.read_text().splitlines()]
    assert len({r["language"] for r in rows} - {"en"}) >= 2
    calls = [c for conv in suite for m in conv.messages for c in m.get("tool_calls") or ()]
    assert len(calls) >= 10 and all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls)
    assert sum(any(m.get("reasoning_content") for m in c.messages) for c in suite) >= 10


def test_the_template_file_and_its_tokenizer_config_are_one_template():
    a, b = chat.load_template(JINJA), chat.load_template(CONFIG)
    assert a.text == b.text and b.bos_token == "<bos>" and b.eos_token == "<eos>"


@pytest.mark.parametrize("thinking", [True, False])
def test_every_conversation_renders_with_the_assistants_text_in_order(suite, thinking):
    template = chat.load_template(CONFIG)
    for conversation in suite:
        text = template.render(conversation, enable_thinking=thinking)
        assert text.startswith("<bos><start_of_turn>user\n") and text.endswith("<end_of_turn>\n")
        at = 0
        for piece in assistant_texts(conversation, thinking):
            found = text.find(piece, at)
            assert found >= at, (conversation.id, piece[:60])
            at = found + len(piece)
        reasoning = [m["reasoning_content"].strip() for m in conversation.messages if m.get("reasoning_content")]
        assert all((r in text) == thinking for r in reasoning)


def test_a_prompt_rendering_ends_where_the_model_answers(suite):
    template = chat.load_template(CONFIG)
    conversation = next(c for c in suite if c.category == "tool_calls")
    prompt = template.render(conversation, add_generation_prompt=True, upto=conversation.last_assistant)
    whole = template.render(conversation)
    assert prompt.endswith("<start_of_turn>model\n") and whole.startswith(prompt)


@pytest.mark.parametrize("line, fragment", [
    ("not json", "not JSON"),
    ('{"messages": []}', "non-empty list `messages`"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "role"),
    ('{"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", '
     '"function": {"name": "f", "arguments": "{not json"}}]}]}', "arguments of tool call 'f' are not JSON"),
    ('{"messages": [{"role": "tool", "tool_call_id": "c9", "content": "{}"}]}', "answers no earlier tool call"),
])
def test_a_bad_conversation_is_one_message_naming_its_line(tmp_path, line, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "fine"}]}\n' + line + "\n")
    with pytest.raises(QevalError, match=f"{path}:2") as info:
        chat.load_conversations(str(path))
    assert fragment in str(info.value)


def test_bad_templates_and_arguments_are_refused(tmp_path, suite):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(QevalError, match="not valid Jinja"):
        chat.load_template(broken).render(suite[0])
    no_template = tmp_path / "tokenizer_config.json"
    no_template.write_text('{"bos_token": "<bos>"}')
    with pytest.raises(QevalError, match="holds no chat_template"):
        chat.load_template(no_template)
    raising = tmp_path / "raising.jinja"
    raising.write_text("{{ raise_exception('system messages are not supported') }}")
    with pytest.raises(QevalError, match="fails on conversation .*system messages are not supported"):
        chat.load_template(raising).render(suite[0])
    with pytest.raises(QevalError, match="must be a JSON object"):
        chat.parse_template_kwargs("[1]")


def edited(text: str) -> str:
    """The shipped template with one change a conversion might make: no newline after <think>."""
    edit = text.replace("'<think>\\n'", "'<think>'")
    assert edit != text
    return edit


def test_template_check_passes_equal_renderings_and_locates_the_first_difference(tmp_path, suite):
    same_text = tmp_path / "reformatted.jinja"  # another text (a comment added), the same renderings
    same_text.write_text("{#- reformatted -#}\n" + JINJA.read_text())
    other = tmp_path / "other.jinja"
    other.write_text(edited(JINJA.read_text()))

    res = run_cli("template", CONFIG, JINJA, "-m", same_text, "--json")
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout)
    assert [c["same_text"] for c in result["candidates"]] == [True, False] and result["passed"]

    res = run_cli("template", CONFIG, other, "--json")
    assert res.returncode == 1, res.stderr
    (checked,) = json.loads(res.stdout)["candidates"]
    first = checked["first_difference"]
    thinking = [c for c in suite if any(m.get("reasoning_content") for m in c.messages)]
    assert checked["differing"] == sum(1 + (c.last_assistant is not None and any(
        m.get("reasoning_content") for m in c.messages[:c.last_assistant])) for c in thinking)
    shared = min(first["char"], templates.CONTEXT_CHARS)  # both excerpts start at the same place, before the difference
    assert first["reference"][:shared] == first["candidate"][:shared] and first["reference"][shared] != first["candidate"][shared]
    assert "<think>\n" in first["reference"] and "<think>\n" not in first["candidate"]
    text = run_cli("template", CONFIG, other).stdout
    assert "DIFF" in text and "FAILED: 1 of 1" in text and "first difference: " + first["sample"] in text


def test_template_check_bad_input_is_exit_2(tmp_path):
    assert_cli_error(run_cli("template", JINJA), "at least one")
    assert run_cli("template", JINJA).returncode == 2
    assert_cli_error(run_cli("template", JINJA, tmp_path / "missing.jinja"), "does not exist")
    assert_cli_error(run_cli("template", JINJA, CONFIG, "--chat-template-kwargs", "{oops"), "not JSON")
    assert_cli_error(run_cli("template", JINJA, CONFIG, "--corpus", tmp_path), "no *.jsonl")


# --------------------------------------------------------------------------------------------------
# GGUFs: the template inside a model file
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def template_ggufs(tmp_path_factory, gemma_tokenizer) -> dict[str, Path]:
    """Tiny models with Gemma-3's tokenizer that differ only in their chat template (and one without)."""
    directory = tmp_path_factory.mktemp("template-ggufs")
    string = (gguf.GGUFValueType.STRING,)
    texts = {"original": JINJA.read_text(), "copy": JINJA.read_text(), "edited": edited(JINJA.read_text())}
    models = {name: tinymodels.build_mamba(directory / f"{name}.gguf", [
        *gemma_tokenizer, tinymodels.MetadataEntry("tokenizer.chat_template", text, string)])
        for name, text in texts.items()}
    models["none"] = tinymodels.build_mamba(directory / "none.gguf", gemma_tokenizer)
    return models


def test_ggufs_with_one_template_pass_and_one_edited_fails_at_its_token(template_ggufs, suite):
    g = template_ggufs
    template = chat.load_template(g["original"])
    assert template.text == JINJA.read_text() and template.bos_token == "<bos>" and template.eos_token == "<eos>"

    res = run_cli("template", CONFIG, "-m", g["original"], "-m", g["copy"], "--json")
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout)
    assert result["compared_as"] == "tokens" and result["vocab"] == str(g["original"])

    res = run_cli("template", g["original"], g["edited"], "--json")
    assert res.returncode == 1
    first = json.loads(res.stdout)["candidates"][0]["first_difference"]
    sample = next(s for s in templates.samples(suite, {}) if s.name == first["sample"])
    whole = chat.load_template(g["original"]).render(sample.conversation, **sample.kwargs)
    # the token index counts the tokens of the common prefix, as llama.cpp's tokenizer splits the rendering
    with LlamaModel(g["original"]) as vocab:
        prefix = vocab.tokenize(whole[:first["char"]], add_special=False, parse_special=True)
    assert first["token"] in (len(prefix) - 1, len(prefix))
    assert whole[first["char"] - len("<think>"):first["char"]] == "<think>"


def test_a_gguf_without_a_template_is_refused_with_what_to_do(template_ggufs):
    msg = assert_cli_error(run_cli("template", CONFIG, template_ggufs["none"]), "carries no chat template",
                           "--chat-template")
    assert "none.gguf" in msg


def test_conversations_from_a_hub_dataset(tmp_path):
    """Rows of an hf: dataset (through the real `datasets` library, on a local parquet file) as conversations:
    messages in a column, tools as JSON text or absent, ids and categories from the rows or the dataset's name."""
    import datasets

    rows = [json.loads(line) for line in (SUITE / "tool_calls.jsonl").read_text().splitlines()[:2]]
    table = {"conversation": [r["messages"] for r in rows], "tools": [json.dumps(r.get("tools")) for r in rows],
             "id": [r["id"] for r in rows]}
    path = tmp_path / "data.parquet"
    datasets.Dataset.from_dict(table).to_parquet(str(path))
    calls = []

    def loader(name, config, split):
        calls.append((name, config, split))
        return datasets.load_dataset("parquet", data_files=str(path), split="train")

    got = chat.load_conversations("hf:owner/agent-chats/all:train#conversation", hf_loader=loader)
    assert calls == [("owner/agent-chats", "all", "train")]
    assert [c.id for c in got] == [r["id"] for r in rows] and {c.category for c in got} == {"agent-chats"}
    assert got[0].tools == rows[0].get("tools")
    template = chat.load_template(CONFIG)
    assert template.render(got[0]) == template.render(chat.load_conversations(str(SUITE / "tool_calls.jsonl"))[0])
    with pytest.raises(QevalError, match="no column 'messages'"):
        chat.load_conversations("hf:owner/agent-chats/all", hf_loader=loader)
