"""Chat data: ``{"messages": [{"role": ..., "content": ...}, ...]}`` lines, rendered with the checkpoint's chat
template as transformers' ``apply_chat_template`` renders it, and the tokens of the assistant turns.

The template is the checkpoint's ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template`` (a
string, or a list of named templates: the one named "default"). It is rendered in a sandboxed Jinja environment
set up as transformers sets up its own (``trim_blocks``, ``lstrip_blocks``, loop controls, its ``tojson``,
``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``), with the messages, no tools,
``add_generation_prompt`` and the tokenizer's special tokens by name (``bos_token``, ``eos_token``, ...), and the
text is tokenized without adding special tokens: the same token ids as ``AutoTokenizer.apply_chat_template``.

Which tokens carry a loss (``--chat-loss assistant``, the default): where the template marks the assistant's
text with ``{% generation %}`` blocks, those characters, as transformers' ``return_assistant_tokens_mask``; else
each assistant turn as the template adds it, rendered prefix by prefix: the text that ``messages[:i + 1]`` adds to
``messages[:i]`` rendered with the generation prompt (the assistant's content and the template's end of turn). A
template that rewrites earlier turns when a later one is added (so that the prefixes are not prefixes of the whole)
is refused by name for that mode; ``--chat-loss all`` puts the loss on every token.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from checkpoints_tools import read_json_object

#: The special tokens a template sees by name, as transformers passes its tokenizer's special_tokens_map.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: Names a message's reasoning comes under; transformers copies any of them to ``reasoning_content`` (which chat
#: templates read) and ``thinking``.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A chat template is missing, unreadable, or cannot render a conversation; the message says which."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: records the character ranges its body renders to, while a
    render is tracked (transformers' AssistantTracker)."""

    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        self._tracking = ContextVar("generation_tracking", default=None)
        environment.extend(track_generation=self.track)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _body(self, context, caller) -> str:
        text = caller()
        tracking = self._tracking.get()
        if tracking is not None:
            blocks, spans = tracking
            start = len("".join(blocks))
            spans.append((start, start + len(text)))
        return text

    @contextmanager
    def track(self, blocks: list[str], spans: list[tuple[int, int]]):
        token = self._tracking.set((blocks, spans))
        try:
            yield
        finally:
            self._tracking.reset(token)


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attributes (as transformers' sandbox does)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore-prefixed attributes "
                                                  f"({name!r})")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       dict=lambda *a, **k: dict(*a, **k), namespace=_Namespace)
    return env


def _aliased(messages: list[dict]) -> list[dict]:
    """The messages with a reasoning field copied under the names templates read, as transformers does."""
    out = []
    for m in messages:
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


class ChatTemplate:
    """A chat template and the special tokens it sees, rendered as transformers renders it."""

    def __init__(self, source: str, special_tokens: dict[str, str], where: str = "the chat template"):
        self.source, self.special_tokens, self.where = source, dict(special_tokens), where
        try:
            self.template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{where}: not a valid Jinja template (line {e.lineno}: {e.message})") from None
        self.marks_generation = re.search(r"\{%-?\s*generation\s*-?%\}", source) is not None

    @classmethod
    def from_checkpoint(cls, directory: str, special_tokens: dict[str, str]) -> ChatTemplate | None:
        """The template of a checkpoint directory (see the module docstring) with the tokenizer's
        ``special_tokens`` by name (``ligermodels.train.data.special_token_names``), or None when it has none."""
        path = os.path.join(directory, "chat_template.jinja")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return cls(f.read(), special_tokens, path)
        path = os.path.join(directory, "tokenizer_config.json")
        source = read_json_object(path, ChatTemplateError, "tokenizer_config.json").get("chat_template") \
            if os.path.isfile(path) else None
        if isinstance(source, list):
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        return cls(source, special_tokens, path) if isinstance(source, str) else None

    def render(self, messages: list[dict], add_generation_prompt: bool = False,
               spans: list[tuple[int, int]] | None = None) -> str:
        """The text of ``messages``; with ``spans``, the character ranges of ``{% generation %}`` blocks are
        appended to it. A template error (``raise_exception`` included) is a ChatTemplateError."""
        kwargs = dict(messages=_aliased(messages), tools=None, documents=None,
                      add_generation_prompt=add_generation_prompt, **self.special_tokens)
        try:
            if spans is None:
                return self.template.render(**kwargs)
            blocks: list[str] = []
            with self.template.environment.track_generation(blocks, spans):
                for block in self.template.generate(**kwargs):
                    blocks.append(block)
            return "".join(blocks)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"{self.where} cannot render this conversation: {e}") from None

    def loss_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(the conversation's text, the character ranges of its assistant turns: see the module docstring)."""
        if self.marks_generation:
            spans: list[tuple[int, int]] = []
            return self.render(messages, spans=spans), spans
        text = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[:i + 1])
            if not (text.startswith(through) and through.startswith(before)):
                raise ChatTemplateError(f"{self.where} renders the conversation's assistant turn {i} differently "
                                        "once later turns follow (it rewrites earlier turns), so its tokens cannot "
                                        "be found; mark them with {% generation %} in the template, or pass "
                                        "--chat-loss all")
            spans.append((len(before), len(through)))
        return text, spans


def check_messages(messages: object) -> str | None:
    """Why ``messages`` is not a conversation (a non-empty list of {"role": str, "content": str or list}), or
    None when it is one."""
    if not isinstance(messages, list) or not messages:
        return "\"messages\" must be a non-empty list of {\"role\", \"content\"} objects"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"message {i} must be an object with a string \"role\""
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            return f"message {i}: \"content\" must be a string or a list of content blocks"
    return None
