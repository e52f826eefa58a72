"""Tool format and configuration, without servers: parsing, validation, prompts through chat templates, secrets."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "mcp"))
from agent_templates import QWEN25  # noqa: E402

from dark.agent.mcp_client import ServerConfig, ToolSpec, expand_vars, parse_config, redact_args, redact_url  # noqa: E402
from dark.agent.tools import (Toolbox, cut_to_tokens, fallback_tools_prompt, format_call, format_turn,  # noqa: E402
                              parse_tool_calls, tool_role, tools_system_prompt, validate_arguments)
from dark.errors import InvalidRequestError  # noqa: E402

TIME_SCHEMA = {"type": "object", "properties": {"timezone": {"type": "string", "description": "IANA timezone name"}},
               "required": ["timezone"]}
SUM_SCHEMA = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
              "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}
TOOLS = [ToolSpec("time", "get_current_time", "Get the current time in a timezone.", TIME_SCHEMA),
         ToolSpec("calc", "get-sum", "Add two numbers.", SUM_SCHEMA)]


@pytest.fixture(scope="module")
def tokenizer(smollm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_path)


@pytest.fixture(scope="module")
def qwen_tokenizer(smollm_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm_path)
    tok.chat_template = QWEN25
    return tok


# --- parsing ---

def test_parse_several_calls_in_one_turn():
    text = ("I will look both up.\n"
            + format_call("get_current_time", {"timezone": "Asia/Tokyo"}) + "\n"
            + '<tool_call>\n{"name": "get-sum", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "I will look both up."
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("get_current_time", {"timezone": "Asia/Tokyo"}, None), ("get-sum", {"a": 1, "b": 2}, None)]


def test_parse_two_objects_in_one_block_and_unclosed_last_block():
    text = ('<tool_call>{"name": "a", "arguments": {}}\n{"name": "b", "arguments": {"x": 1}}</tool_call>'
            '<tool_call>\n{"name": "c", "arguments": {"y": "z"}}')   # generation stopped before the closing tag
    _, calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [("a", {}), ("b", {"x": 1}), ("c", {"y": "z"})]
    assert all(c.error is None for c in calls)


def test_parse_malformed_calls_give_errors_not_exceptions():
    text = ('<tool_call>{"name": "get_current_time", "arguments": {"timezone": "Asia/Tokyo"</tool_call>'
            '<tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>["get_current_time"]</tool_call>'
            '<tool_call>{"name": "get-sum", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
            '<tool_call>{"name": "get-sum", "arguments": "not json"}</tool_call>'
            '<tool_call>  </tool_call>')
    _, calls = parse_tool_calls(text)
    assert len(calls) == 6
    assert "not valid JSON" in calls[0].error and "<tool_call>" in calls[0].error   # says how to write it
    assert "no \"name\"" in calls[1].error
    assert "JSON object" in calls[2].error
    assert calls[3].error is None and calls[3].arguments == {"a": 1, "b": 2}       # arguments as a JSON string
    assert calls[4].name == "get-sum" and "not valid JSON" in calls[4].error
    assert "empty" in calls[5].error


def test_parse_plain_answer_and_bare_json_call():
    assert parse_tool_calls("It is noon in Tokyo.") == ("It is noon in Tokyo.", [])
    bare = '{"name": "get_current_time", "arguments": {"timezone": "UTC"}}'
    assert parse_tool_calls(bare) == (bare, [])                  # without knowing the tools: just text
    _, calls = parse_tool_calls(bare, known={"get_current_time"})
    assert [(c.name, c.arguments) for c in calls] == [("get_current_time", {"timezone": "UTC"})]
    assert parse_tool_calls('{"name": "other", "arguments": {}}', known={"get_current_time"})[1] == []


def test_format_round_trip():
    turn = format_turn("", [("get_current_time", {"timezone": "Europe/Paris"}), ("get-sum", {"a": 1, "b": 2})])
    assert turn == ('<tool_call>\n{"name": "get_current_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "get-sum", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert [(c.name, c.arguments) for c in parse_tool_calls(turn)[1]] == [
        ("get_current_time", {"timezone": "Europe/Paris"}), ("get-sum", {"a": 1, "b": 2})]


# --- validation ---

def test_validate_arguments_against_schema():
    assert validate_arguments(SUM_SCHEMA, {"a": 1, "b": 2.5}) == []
    problems = validate_arguments(SUM_SCHEMA, {"a": "one"})
    assert any(p.startswith("a: 'one' is not of type 'number'") for p in problems)
    assert any("'b' is a required property" in p for p in problems)
    assert validate_arguments({"type": "nonsense-type"}, {"x": 1}) == []   # a broken schema: the server judges


def test_toolbox_checks_unknown_tools_and_schema():
    box = Toolbox(TOOLS)
    assert box.check("get_current_time", {"timezone": "UTC"}) is None
    assert "no tool named 'get_time'" in box.check("get_time", {}) and "get_current_time" in box.check("get_time", {})
    err = box.check("get-sum", {"a": 1})
    assert "invalid arguments for get-sum" in err and "'b' is a required property" in err


def test_toolbox_qualifies_colliding_names():
    box = Toolbox([ToolSpec("one", "search", "", {"type": "object"}), ToolSpec("two", "search", "", {"type": "object"}),
                   ToolSpec("two", "fetch", "", {"type": "object"})])
    assert box.names() == ["one_search", "two_search", "fetch"]
    assert box.get("two_search").server == "two" and box.get("two_search").name == "search"


# --- prompts through the chat template ---

def test_qwen_template_renders_tools_natively(qwen_tokenizer):
    box = Toolbox(TOOLS)
    system, native = tools_system_prompt(qwen_tokenizer, "You are a helpful assistant.", box.functions())
    assert native and "<tools>" in system and '"name": "get-sum"' in system
    # the messages we serve and teach render to exactly what the template makes of tools=
    history = [{"role": "user", "content": "What time is it in Tokyo?"}]
    ours = qwen_tokenizer.apply_chat_template([{"role": "system", "content": system}] + history, tokenize=False,
                                              add_generation_prompt=True)
    native_render = qwen_tokenizer.apply_chat_template([{"role": "system", "content": "You are a helpful assistant."}]
                                                       + history, tools=box.functions(), tokenize=False,
                                                       add_generation_prompt=True)
    assert ours == native_render
    # an assistant turn we write renders like the template's own tool_calls, and tool results like its tool role
    call = {"name": "get_current_time", "arguments": {"timezone": "Asia/Tokyo"}}
    ours = qwen_tokenizer.apply_chat_template(
        [{"role": "system", "content": system}] + history
        + [{"role": "assistant", "content": format_turn("", [(call["name"], call["arguments"])])},
           {"role": "tool", "content": "09:00"}], tokenize=False)
    theirs = qwen_tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are a helpful assistant."}] + history
        + [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
           {"role": "tool", "content": "09:00"}], tools=box.functions(), tokenize=False)
    assert ours == theirs
    assert tool_role(qwen_tokenizer) == "tool"


def test_smollm_template_falls_back_to_the_same_format(tokenizer, qwen_tokenizer):
    box = Toolbox(TOOLS)
    system, native = tools_system_prompt(tokenizer, "You are a helpful assistant.", box.functions())
    assert not native
    assert system == fallback_tools_prompt("You are a helpful assistant.", box.functions())
    # the fallback text is what Qwen's own template writes into its system turn
    assert system == tools_system_prompt(qwen_tokenizer, "You are a helpful assistant.", box.functions())[0]
    for f in box.functions():
        assert json.dumps(f, ensure_ascii=False) in system   # full JSON schemas reach the model
    assert tool_role(tokenizer) == "tool"


def test_cut_to_tokens(tokenizer):
    text = "\n".join(f"line {i}: the quick brown fox" for i in range(500))
    short, cut = cut_to_tokens(tokenizer, text, 100)
    assert cut and len(tokenizer(short)["input_ids"]) <= 110
    assert short.startswith("line 0:") and short.rstrip().endswith("fox") and "tokens cut" in short
    assert cut_to_tokens(tokenizer, "short", 100) == ("short", False)


# --- configuration and secrets ---

def test_config_parsing_and_errors(tmp_path):
    cfgs = parse_config({"mcpServers": {
        "fs": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem"], "roots": [str(tmp_path)],
               "autoApprove": ["read_file"]},
        "api": {"url": "https://example.com/mcp", "headers": {"Authorization": "Bearer x"}, "auto_approve": True},
        "legacy": {"url": "https://example.com/sse", "type": "sse"}}})
    assert cfgs["fs"].transport == "stdio" and cfgs["fs"].roots == [str(tmp_path.resolve())]
    assert cfgs["fs"].approves("read_file") and not cfgs["fs"].approves("write_file")
    assert cfgs["api"].transport == "http" and cfgs["api"].approves("anything")
    assert cfgs["legacy"].transport == "sse" and cfgs["fs"].adapter_name == "mcp-fs"
    bad = [({"command": "x", "url": "y"}, "exactly one of"), ({}, "exactly one of"),
           ({"command": "x", "roots": [str(tmp_path / "missing")]}, "not an existing directory"),
           ({"command": "x", "env": {"A": 1}}, "object of strings"), ({"command": "x", "auto_approve": "yes"}, "auto_approve"),
           ({"command": "x", "timeout": 0}, "timeout"), ({"url": "x", "type": "stdio"}, "does not fit")]
    for raw, message in bad:
        with pytest.raises(InvalidRequestError, match=message):
            ServerConfig.from_dict("s", raw)
    with pytest.raises(InvalidRequestError, match="not valid"):
        ServerConfig.from_dict("bad name!", {"command": "x"})


def test_public_view_never_shows_secrets(monkeypatch):
    cfg = ServerConfig.from_dict("gh", {
        "command": "server", "args": ["--api-key", "sk-live-123", "--token=abc", "--verbose", "${GH_TOKEN}", "/data"],
        "env": {"GITHUB_TOKEN": "ghp_secret"}})
    http = ServerConfig.from_dict("api", {"url": "https://user:pw@example.com/mcp?key=k123&x=1",
                                          "headers": {"Authorization": "Bearer tok-999"}})
    views = json.dumps([cfg.public_view(), http.public_view()])
    for secret in ("sk-live-123", "abc", "ghp_secret", "GH_TOKEN", "pw@", "k123", "tok-999"):
        assert secret not in views, secret
    assert "GITHUB_TOKEN" in views and "Authorization" in views and "/data" in views and "--verbose" in views
    assert redact_url("https://example.com/mcp") == "https://example.com/mcp"
    assert redact_args(["-y", "@modelcontextprotocol/server-filesystem", "/tmp"]) == ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"]
    # the file's own copy keeps them, for the server to use
    assert cfg.to_dict()["env"] == {"GITHUB_TOKEN": "ghp_secret"}
    monkeypatch.setenv("GH_TOKEN", "from-env")
    assert expand_vars("Bearer ${GH_TOKEN}", "x") == "Bearer from-env"
    with pytest.raises(Exception, match="MISSING_VAR"):
        expand_vars("${MISSING_VAR}", "mcpServers.gh.env.X")


def test_function_schema_is_the_openai_shape():
    spec = copy.deepcopy(TOOLS[0])
    f = spec.function_schema()
    assert f == {"type": "function", "function": {"name": "get_current_time", "description": spec.description,
                                                  "parameters": TIME_SCHEMA}}
