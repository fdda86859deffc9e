#!/usr/bin/python3
"""Renders a conversation with a Hugging Face model's chat template, as transformers' apply_chat_template does
(text only, not tokenized): Jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loop
controls (break, continue), a `{% generation %}` block that only renders its body, the `tojson` filter as
transformers defines it (json.dumps with ensure_ascii=False, indent, separators, sort_keys; no HTML escaping), the
globals `raise_exception` (a TemplateError with the message) and `strftime_now` (the local time), and the variables
messages, tools, documents (None), add_generation_prompt and the tokenizer's special tokens (bos_token, eos_token,
unk_token, sep_token, pad_token, cls_token, mask_token, additional_special_tokens: those tokenizer_config.json sets,
a dict's `content`).

The template: --chat-template FILE, else the directory's chat_template.jinja, else tokenizer_config.json's
`chat_template` (a string, or a list of {name, template}: "tool_use" when tools are given and it exists, else
"default"), else chat_template.json's. The special tokens: tokenizer_config.json's, then special_tokens_map.json's for
those it lacks.

  scripts/chat_template.py --tokenizer DIR [--chat-template FILE] [--add-generation-prompt] < conversation.json

The input is one JSON value: {"messages": [{"role", "content"}, ...], "tools": [...], "system": "..."} (a top-level
`system` becomes a first system message) or a bare list of messages. Prints the rendered text as it is (no newline
added); exits 1 with the template's error. Used by scripts/prepare_data --chat (imported) and meshtrain generate
--chat (run)."""
import argparse
import datetime
import json
import os
import sys

try:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError:  # reported when a template is compiled, so that importing this module never fails
    jinja2 = None

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(Exception):
    """A template that cannot be found, compiled or rendered; the message says which and why."""


def _token_text(v):
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ChatTemplateError(f"{path}: {e}")


def special_tokens(tokenizer_dir):
    """The special-token variables a template sees: name -> text (additional_special_tokens: a list)."""
    out = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(tokenizer_dir, name)
        if not os.path.isfile(path):
            continue
        cfg = _read_json(path)
        if not isinstance(cfg, dict):
            continue
        for key in SPECIAL_TOKEN_KEYS:
            if key not in out and _token_text(cfg.get(key)) is not None:
                out[key] = _token_text(cfg[key])
        extra = cfg.get("additional_special_tokens")
        if "additional_special_tokens" not in out and isinstance(extra, list):
            out["additional_special_tokens"] = [t for t in map(_token_text, extra) if t is not None]
    return out


def find_template(tokenizer_dir, template_file=None, tools=False):
    """The template's text and where it came from."""
    if template_file:
        try:
            with open(template_file, encoding="utf-8") as f:
                return f.read(), template_file
        except OSError as e:
            raise ChatTemplateError(f"--chat-template {template_file}: {e.strerror}")
    jinja_file = os.path.join(tokenizer_dir, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read(), jinja_file
    for name in ("tokenizer_config.json", "chat_template.json"):
        path = os.path.join(tokenizer_dir, name)
        if not os.path.isfile(path):
            continue
        t = _read_json(path)
        t = t.get("chat_template") if isinstance(t, dict) else None
        if isinstance(t, str):
            return t, path
        if isinstance(t, list):
            named = {e.get("name"): e.get("template") for e in t if isinstance(e, dict)}
            pick = "tool_use" if tools and isinstance(named.get("tool_use"), str) else "default"
            if isinstance(named.get(pick), str):
                return named[pick], f"{path} ({pick})"
            raise ChatTemplateError(f"{path}: chat_template lists {sorted(map(str, named))}, no 'default'")
    if not os.path.isdir(tokenizer_dir):
        raise ChatTemplateError(f"{tokenizer_dir}: not a directory")
    raise ChatTemplateError(f"{tokenizer_dir}: no chat template (tokenizer_config.json has no 'chat_template' and "
                            "there is no chat_template.jinja); give one with --chat-template FILE")


def _environment():
    if jinja2 is None:
        raise ChatTemplateError("python3-jinja2 is not installed (scripts/setup.sh installs it: apt-get install "
                                "python3-jinja2)")

    class GenerationBlock(jinja2.ext.Extension):
        # {% generation %}...{% endgeneration %} (transformers' assistant tracker): the body, rendered as it is.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class ChatTemplate:
    """A compiled chat template and the special tokens it sees."""

    def __init__(self, source, special=None, origin="<template>"):
        self.source, self.special, self.origin = source, dict(special or {}), origin
        try:
            self.template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{origin}: line {e.lineno}: {e.message}")

    @classmethod
    def from_dir(cls, tokenizer_dir, template_file=None, tools=False):
        source, origin = find_template(tokenizer_dir, template_file, tools)
        return cls(source, special_tokens(tokenizer_dir), origin)

    def render(self, messages, tools=None, add_generation_prompt=False, documents=None, **kwargs):
        """The text, as apply_chat_template(messages, tools=tools, add_generation_prompt=..., tokenize=False);
        a ChatTemplateError when the template raises (raise_exception, an undefined name, the sandbox)."""
        variables = {**self.special, **kwargs}
        try:
            return self.template.render(messages=messages, tools=tools, documents=documents,
                                        add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as e:  # raise_exception's message as it is; others named
            raise ChatTemplateError(str(e) if type(e) is jinja2.exceptions.TemplateError
                                    else f"{type(e).__name__}: {e}")
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError,
                RecursionError) as e:
            raise ChatTemplateError(f"{type(e).__name__}: {e}")


def conversation(obj):
    """(messages, tools) of a conversation object ({"messages", "tools", "system"}) or a bare message list; a
    ValueError saying what is wrong. A top-level `system` becomes a first system message."""
    if isinstance(obj, list):
        obj = {"messages": obj}
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    msgs = obj.get("messages")
    if msgs is None:
        raise ValueError("no 'messages'" + (" (and no 'text')" if "text" not in obj else ""))
    if not isinstance(msgs, list) or not msgs:
        raise ValueError("'messages' is not a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ValueError(f"message {i + 1} is not an object")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"message {i + 1}: unknown role {json.dumps(role, ensure_ascii=False)} "
                             f"(known: {', '.join(ROLES)})")
    system = obj.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise ValueError("'system' is not a string")
        if msgs[0].get("role") == "system":
            raise ValueError("both a top-level 'system' and a first system message")
        msgs = [{"role": "system", "content": system}] + msgs
    tools = obj.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError("'tools' is not a list")
    return msgs, tools


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, metavar="DIR",
                    help="a Hugging Face model directory (tokenizer_config.json with chat_template)")
    ap.add_argument("--chat-template", default=None, metavar="FILE", help="the template's text (a Jinja file)")
    ap.add_argument("--add-generation-prompt", action="store_true",
                    help="end with the header of the assistant's next turn")
    a = ap.parse_args()
    try:
        obj = json.loads(sys.stdin.buffer.read().decode("utf-8"))
        msgs, tools = conversation(obj)
        t = ChatTemplate.from_dir(a.tokenizer, a.chat_template, tools=bool(tools))
        text = t.render(msgs, tools=tools, add_generation_prompt=a.add_generation_prompt)
        out = text.encode("utf-8")
    except (ValueError, UnicodeError) as e:
        sys.exit(f"chat_template: the conversation on stdin: {e}")
    except ChatTemplateError as e:
        sys.exit(f"chat_template: {e}")
    sys.stdout.buffer.write(out)


if __name__ == "__main__":
    main()
