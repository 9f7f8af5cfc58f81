"""Conversations in the OpenAI chat shape, and the chat templates that render them into a model's text.

A conversation corpus is a JSONL file, a folder of them (a row's category is its `category` field, else its
file's name), the shipped suite `conversations` (qeval/corpora/conversations), or a Hugging Face dataset
`hf:DATASET[/CONFIG][:SPLIT][#COLUMN]` whose rows hold the messages in COLUMN (default `messages`) and
optionally `tools` (a list, or its JSON text), `id` and `category` (else the dataset's name). A row:

    {"id": "...", "category": "...", "messages": [...], "tools": [...]}

messages: `role` system/user/assistant/tool and `content` (a string, a list of {"text": ...} parts, or null);
an assistant message may hold `reasoning_content` (its thinking) and `tool_calls` ([{"id", "type":
"function", "function": {"name", "arguments": JSON text}}]); a tool message answers one by `tool_call_id`.
tools: OpenAI function schemas.

A chat template is Jinja text, as a GGUF carries it (`tokenizer.chat_template`), a .jinja file, or a Hugging
Face `tokenizer_config.json` holding `chat_template`. It renders as Hugging Face transformers renders it
(and llama.cpp's --jinja, whose minja engine follows transformers): a sandboxed Jinja environment with
trim_blocks and lstrip_blocks, `tojson` that keeps key order and writes UTF-8, `raise_exception` and
`strftime_now`, the variables messages, tools, bos_token, eos_token, add_generation_prompt, and any
keyword arguments (--chat-template-kwargs, e.g. {"enable_thinking": false}).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from importlib import resources
from pathlib import Path

from qeval.engine.engine import LlamaModel
from qeval.engine.modelinfo import is_model_file
from qeval.errors import QevalError
from qeval.inputs.corpus import load_hf_rows, parse_hf_spec

SHIPPED = "conversations"  # the shipped suite's name as a corpus
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Conversation:
    id: str
    category: str
    messages: list[dict]
    tools: list[dict] | None = None

    @property
    def last_assistant(self) -> int | None:
        """Index of the last assistant message (the turn a prompt-only rendering stops before)."""
        found = [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]
        return found[-1] if found else None


def shipped_dir() -> Path:
    return Path(str(resources.files("qeval.corpora"))) / SHIPPED


def load_conversations(spec: str, hf_loader=None) -> list[Conversation]:
    """The conversations of a JSONL file, a folder of *.jsonl files, the shipped suite (`conversations`) or an
    hf: dataset (hf_loader: datasets.load_dataset's stand-in, for tests)."""
    if spec.startswith("hf:"):
        return _unique_ids(load_hf_conversations(spec, hf_loader), spec)
    path = shipped_dir() if spec == SHIPPED else Path(spec)
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise QevalError(f"{path} holds no *.jsonl conversation file")
    elif path.is_file():
        files = [path]
    else:
        raise QevalError(f"conversation corpus {spec!r} is neither a JSONL file, a folder of them, nor {SHIPPED!r}")
    return _unique_ids([c for f in files for c in _read_jsonl(f)], spec)


def _unique_ids(conversations: list[Conversation], spec: str) -> list[Conversation]:
    ids = [c.id for c in conversations]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise QevalError(f"conversation ids must be unique in {spec}: {', '.join(repeated[:5])} repeat")
    return conversations


def load_hf_conversations(spec: str, loader=None) -> list[Conversation]:
    """The rows of a hub dataset as conversations (see the module docstring)."""
    dataset, config, split, column = parse_hf_spec(spec, default_column="messages")
    rows = load_hf_rows(dataset, config, split, column, loader, local="a local JSONL file")
    out = []
    for n, row in enumerate(rows):
        where = f"{spec} row {n}"
        tools = row.get("tools")
        if isinstance(tools, str):  # datasets often keep tool schemas as JSON text
            try:
                tools = json.loads(tools) if tools.strip() else None
            except json.JSONDecodeError:
                raise QevalError(f"{where}: `tools` is text but not JSON") from None
        fields = {"messages": row[column], "tools": tools, "id": row.get("id"), "category": row.get("category")}
        out.append(parse_conversation(fields, where, default_id=f"{dataset}-{n}",
                                      default_category=dataset.rsplit("/", 1)[-1]))
    return out


def _read_jsonl(path: Path) -> list[Conversation]:
    out = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise QevalError(f"cannot read conversations from {path}: {exc}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise QevalError(f"{where}: not JSON ({exc.msg})") from None
        out.append(parse_conversation(row, where, default_id=f"{path.stem}-{n}", default_category=path.stem))
    return out


def parse_conversation(row: object, where: str, default_id: str, default_category: str) -> Conversation:
    """A checked Conversation from one row (a JSONL line or a dataset row); QevalError naming what is wrong."""
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
        raise QevalError(f"{where}: a conversation is an object with a non-empty list `messages`")
    tools = row.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise QevalError(f"{where}: `tools` must be a list of function schemas")
    open_calls: set[str] = set()
    for i, message in enumerate(row["messages"]):
        _check_message(message, f"{where}: message {i}", open_calls)
    return Conversation(str(row.get("id") or default_id), str(row.get("category") or default_category),
                        row["messages"], tools)


def _check_message(message: object, where: str, open_calls: set[str]) -> None:
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise QevalError(f"{where}: a message is an object whose `role` is one of {', '.join(ROLES)}")
    content = message.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise QevalError(f"{where}: `content` must be a string, a list of parts or null")
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise QevalError(f"{where}: a tool call is {{\"function\": {{\"name\": ..., \"arguments\": ...}}}}")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                json.loads(arguments)
            except json.JSONDecodeError:
                raise QevalError(f"{where}: the arguments of tool call {function['name']!r} are not JSON") from None
        open_calls.add(str(call.get("id")))
    if message["role"] == "tool" and "tool_call_id" in message and message["tool_call_id"] not in open_calls:
        raise QevalError(f"{where}: tool_call_id {message['tool_call_id']!r} answers no earlier tool call")


# --------------------------------------------------------------------------------------------------
# templates
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ChatTemplate:
    text: str
    source: str  # where it came from: a GGUF, a .jinja file, a tokenizer_config.json
    bos_token: str = ""
    eos_token: str = ""
    _compiled: list = field(default_factory=list, repr=False, compare=False)

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def with_special_tokens_of(self, other: "ChatTemplate") -> "ChatTemplate":
        """A bare Jinja file names no BOS/EOS text: it takes those of `other` (the model's, or the reference's)."""
        if self.bos_token or self.eos_token:
            return self
        return ChatTemplate(text=self.text, source=self.source, bos_token=other.bos_token, eos_token=other.eos_token)

    def render(self, conversation: Conversation, add_generation_prompt: bool = False, upto: int | None = None,
               **kwargs) -> str:
        """The conversation's text (its first `upto` messages), as the template writes it; a template that fails
        on it (raise_exception, an undefined call) is one QevalError naming the conversation."""
        import jinja2  # noqa: PLC0415 - only conversations need Jinja

        messages = conversation.messages if upto is None else conversation.messages[:upto]
        try:
            return self._template().render(messages=messages, tools=conversation.tools, bos_token=self.bos_token,
                                           eos_token=self.eos_token, add_generation_prompt=add_generation_prompt,
                                           **kwargs)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise QevalError(f"the chat template of {self.source} fails on conversation {conversation.id!r}: "
                             f"{exc}") from None

    def _template(self):
        if not self._compiled:
            self._compiled.append(compile_template(self.text, self.source))
        return self._compiled[0]


def compile_template(text: str, source: str):
    """The template in a Hugging Face-like sandboxed Jinja environment."""
    import jinja2  # noqa: PLC0415
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    def tojson(value, indent=None, ensure_ascii=False, sort_keys=False, separators=None):
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys, separators=separators)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        raise QevalError(f"the chat template of {source} is not valid Jinja (line {exc.lineno}: {exc.message})") \
            from None


def load_template(spec: str | Path) -> ChatTemplate:
    """The chat template of a GGUF model (`tokenizer.chat_template`, with its vocabulary's BOS and EOS text), a
    .jinja file or a tokenizer_config.json."""
    path = Path(spec)
    if not path.is_file():
        raise QevalError(f"chat template source {spec} does not exist (a GGUF, a .jinja file or a "
                         "tokenizer_config.json)")
    if not is_model_file(path):
        return template_from_text_file(path)
    with LlamaModel(path) as model:
        return template_of_model(model)


def template_of_model(model: LlamaModel) -> ChatTemplate:
    text = model.chat_template()
    if not text:
        raise QevalError(f"{model.model_path} carries no chat template (tokenizer.chat_template): pass one with "
                         "--chat-template FILE (the original model's tokenizer_config.json, or a .jinja file)")
    bos, eos = special_token_texts(model)
    return ChatTemplate(text=text, source=str(model.model_path), bos_token=bos, eos_token=eos)


def special_token_texts(model: LlamaModel) -> tuple[str, str]:
    """The BOS and EOS text of a model's vocabulary ("" where it has none)."""
    return (model.token_text(model.bos) if model.bos >= 0 else "", model.token_text(model.eos) if model.eos >= 0
            else "")


def template_from_text_file(path: Path) -> ChatTemplate:
    """A .jinja file, or a tokenizer_config.json holding `chat_template` (a string, or a list of named
    templates: the one named "default")."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise QevalError(f"cannot read chat template {path}: {exc}") from None
    if path.suffix.lower() != ".json":
        return ChatTemplate(text=text, source=str(path))
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise QevalError(f"{path} is not JSON ({exc.msg}): a chat template file is Jinja text or a "
                         "tokenizer_config.json") from None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if not isinstance(template, str) or not template:
        raise QevalError(f"{path} holds no chat_template")
    return ChatTemplate(text=template, source=str(path), bos_token=_token_text(config.get("bos_token")),
                        eos_token=_token_text(config.get("eos_token")))


def _token_text(token: object) -> str:
    """A tokenizer_config.json special token: a string or {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else ""


def parse_template_kwargs(text: str | None) -> dict:
    """--chat-template-kwargs: a JSON object of extra template variables."""
    if not text:
        return {}
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise QevalError(f"--chat-template-kwargs is not JSON ({exc.msg}): e.g. '{{\"enable_thinking\": false}}'") \
            from None
    if not isinstance(kwargs, dict):
        raise QevalError("--chat-template-kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return kwargs
