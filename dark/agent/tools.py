"""Tools to the model and back: the tool list in the prompt, <tool_call> parsing, argument validation.

The format is Qwen's (Hermes-style): the system turn carries the function signatures inside <tools></tools>,
and the model answers with one or more

    <tool_call>
    {"name": "get_current_time", "arguments": {"timezone": "Asia/Tokyo"}}
    </tool_call>

blocks; tool results go back as "tool" messages.

How the prompt is built. OnlineLLM renders plain message lists (it has no `tools=` argument) and learn examples
are message lists too, so the tool list must live inside the messages for the prompt a model is served and the
prompt it is taught on to be the same tokens. When the tokenizer's own chat template supports tools (Qwen2.5,
Qwen3, ...), `tools_system_prompt` renders it with `apply_chat_template(messages, tools=...)` and lifts out the
system turn the template wrote: the conversation then renders to exactly what the template would produce for
`tools=`. A template without tool support (SmolLM2's ignores `tools=`) gets the documented fallback: the same
Qwen text, written by `fallback_tools_prompt`, in the system turn, and the same <tool_call> JSON format.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

from .mcp_client import ToolSpec

log = logging.getLogger(__name__)

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_CALL_FORMAT = '<tool_call>{"name": <tool name>, "arguments": {<arguments as JSON>}}</tool_call>'


def fallback_tools_prompt(system: str, functions: list[dict]) -> str:
    """The system turn for templates without tool support: the system text, then Qwen2.5's own tool block."""
    lines = [json.dumps(f, ensure_ascii=False) for f in functions]
    return (f"{system}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            + "\n".join(lines) +
            "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")


def _render(tokenizer, messages, **kw) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kw)


def tools_system_prompt(tokenizer, system: str, functions: list[dict]) -> tuple[str, bool]:
    """The content of the system turn that presents `functions` to this tokenizer's model, and whether it came
    from the template itself (True) or from the fallback (False)."""
    if not functions:
        return system, True
    user = {"role": "user", "content": "\x02user\x03"}
    try:
        with_tools = _render(tokenizer, [{"role": "system", "content": system}, user], tools=functions)
        marker = "\x02system\x03"
        frame = _render(tokenizer, [{"role": "system", "content": marker}, user])
        pre, _, post = frame.partition(marker)
        if with_tools.startswith(pre) and with_tools.endswith(post) and len(with_tools) >= len(pre) + len(post):
            content = with_tools[len(pre):len(with_tools) - len(post)]
            names = [f["function"]["name"] for f in functions]
            if content != system and all(n in content for n in names) and \
                    _render(tokenizer, [{"role": "system", "content": content}, user]) == with_tools:
                return content, True
    except Exception as e:  # a template that rejects tools= or system turns: the fallback still works
        log.debug("chat template cannot render tools natively: %s", e)
    return fallback_tools_prompt(system, functions), False


def tool_role(tokenizer) -> str:
    """"tool" when the chat template renders a tool message, else "user" (results then travel as user turns)."""
    probe = "\x02result\x03"
    try:
        text = _render(tokenizer, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                   {"role": "tool", "content": probe}])
        if probe in text:
            return "tool"
    except Exception:
        pass
    return "user"


# --- calls ---

def format_call(name: str, arguments: dict) -> str:
    """One call as the model should write it (byte for byte what Qwen's template writes for a tool_calls entry)."""
    return f'{TOOL_CALL_OPEN}\n{json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}'


def format_turn(content: str, calls: list[tuple[str, dict]]) -> str:
    """An assistant turn: optional text, then each call on its own lines."""
    parts = ([content.strip()] if content.strip() else []) + [format_call(n, a) for n, a in calls]
    return "\n".join(parts)


@dataclass
class ParsedCall:
    """One call as the model wrote it. `error` says what was wrong when it could not be read."""

    name: str | None
    arguments: dict | None
    raw: str
    error: str | None = None


def _call_from_json(obj, raw: str) -> ParsedCall:
    if not isinstance(obj, dict):
        return ParsedCall(None, None, raw, f"a tool call must be a JSON object, not {type(obj).__name__}. "
                                           f"Write {_CALL_FORMAT}.")
    if "function" in obj and isinstance(obj["function"], dict):   # the OpenAI shape, seen in the wild
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParsedCall(None, None, raw, f"the tool call has no \"name\". Write {_CALL_FORMAT}.")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return ParsedCall(name, None, raw, f"the arguments of {name} are not valid JSON ({e.msg}).")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ParsedCall(name, None, raw, f"the arguments of {name} must be a JSON object, not {type(args).__name__}.")
    return ParsedCall(name, args, raw)


def _parse_block(body: str) -> list[ParsedCall]:
    """A <tool_call> body: usually one JSON object; a few models put several in one block."""
    text, calls, decoder, pos = body.strip(), [], json.JSONDecoder(), 0
    if not text:
        return [ParsedCall(None, None, body, f"the tool call is empty. Write {_CALL_FORMAT}.")]
    while pos < len(text):
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            return calls + [ParsedCall(None, None, body, f"the tool call is not valid JSON ({e.msg} at line {e.lineno}, "
                                                         f"column {e.colno}). Write {_CALL_FORMAT}.")]
        calls.append(_call_from_json(obj, text[pos:end]))
        pos = end
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
    return calls


def parse_tool_calls(text: str, known: set[str] | None = None) -> tuple[str, list[ParsedCall]]:
    """Split an assistant turn into its text and its tool calls (in order).

    Each <tool_call> block gives a call, or a ParsedCall with `error` when its JSON cannot be read (the error goes
    back to the model as the tool result). A last block without its closing tag still counts: generation may
    stop there. Without any block, a turn that is nothing but a {"name", "arguments"} object naming one of the
    `known` tools is read as a call too (small models often drop the tags).
    """
    if TOOL_CALL_OPEN not in text:
        stripped = text.strip()
        if known and stripped.startswith("{") and stripped.endswith("}"):
            try:
                obj = json.loads(stripped)
            except json.JSONDecodeError:
                return text, []
            if isinstance(obj, dict) and obj.get("name") in known and set(obj) <= {"name", "arguments", "parameters"}:
                return "", [_call_from_json(obj, stripped)]
        return text, []
    calls = []
    for m in _BLOCK.finditer(text):
        calls.extend(_parse_block(m.group(1)))
    content = _BLOCK.sub("", text).strip()
    return content, calls


# --- validation ---

def validate_arguments(schema: dict, arguments: dict) -> list[str]:
    """What is wrong with `arguments` under the tool's JSON schema (empty when they fit), at most five lines."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    cls = validator_for(schema, default=Draft202012Validator)
    try:
        cls.check_schema(schema)
    except SchemaError as e:  # the server's schema is broken: let the server judge the call itself
        log.warning("a tool's input schema is not valid JSON Schema (%s); skipping validation", e.message)
        return []
    errors = sorted(cls(schema).iter_errors(arguments), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{'.'.join(str(p) for p in e.absolute_path) or 'arguments'}: {e.message}" for e in errors[:5]]


class Toolbox:
    """The tools one agent run offers, under the names the model sees.

    Names stay the servers' own; when two servers offer the same name, both become `<server>_<name>`.
    """

    def __init__(self, specs: list[ToolSpec]):
        counts: dict[str, int] = {}
        for s in specs:
            counts[s.name] = counts.get(s.name, 0) + 1
        self.by_name: dict[str, ToolSpec] = {}
        for s in specs:
            self.by_name[s.name if counts[s.name] == 1 else f"{s.server}_{s.name}"] = s

    def names(self) -> list[str]:
        return list(self.by_name)

    def functions(self) -> list[dict]:
        return [spec.function_schema(name) for name, spec in self.by_name.items()]

    def get(self, name: str) -> ToolSpec | None:
        return self.by_name.get(name)

    def check(self, name: str | None, arguments: dict | None) -> str | None:
        """Why this call cannot run (unknown tool, arguments outside the schema), or None when it can."""
        spec = self.by_name.get(name or "")
        if spec is None:
            return f"there is no tool named {name!r}; the tools are: {', '.join(self.by_name) or 'none'}."
        if not isinstance(arguments, dict):
            return f"the arguments of {name} must be a JSON object."
        problems = validate_arguments(spec.input_schema, arguments)
        if problems:
            return (f"invalid arguments for {name}: " + "; ".join(problems) +
                    f". Its parameters are: {json.dumps(spec.input_schema, ensure_ascii=False)}")
        return None


def cut_to_tokens(tokenizer, text: str, budget: int) -> tuple[str, bool]:
    """`text` within `budget` tokens: its head and tail around a note of what was cut (tool outputs can be huge)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= budget:
        return text, False
    note = f"\n[... {{}} of {len(ids)} tokens cut ...]\n"
    keep = max(budget - len(tokenizer(note.format(len(ids)), add_special_tokens=False)["input_ids"]), 2)
    head, tail = keep * 3 // 4, keep - keep * 3 // 4
    cut = len(ids) - head - tail
    return (tokenizer.decode(ids[:head]) + note.format(cut) + (tokenizer.decode(ids[-tail:]) if tail else "")), True
