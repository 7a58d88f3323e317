"""OpenAI `tools` and `tool_choice`, checked, and the grammars that enforce a choice.

The chat template is shown the tools whatever `tool_choice` says (`template_tools`), as
OpenAI's model and vLLM's prompt see them: "none" only leaves the reply unparsed and
unconstrained; "auto" lets the model answer or call, and its reply is parsed
(tool_parsers.py). "required", a named function, and
`parallel_tool_calls: false` are enforced while the model writes: `tool_call_grammar`
gives a Lark grammar (llguidance's dialect, with the functions' parameter schemas inline
as %json) that admits only calls in the model's own format, to listed functions, with
arguments that follow their schemas; the reply then parses into exactly those calls.
OpenAI's deprecated `functions` / `function_call` are the tools and tool_choice they
stand for (`tools_of_functions`, `tool_choice_of_function_call`).
"""
from __future__ import annotations

import functools
import json
import re

from .errors import RequestError
from .structured import JSON_WHITESPACE, StructuredSpec, compiler_message
from .tool_parsers import PARSER_NAMES, check_parser_name

TOOL_CHOICES = ("none", "auto", "required")
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
# what a tool without parameters takes
_NO_PARAMETERS = {"type": "object", "properties": {}}


def template_tools(tokenizer, tools, tool_choice, chat_template: str | None = None,
                   template_kwargs: dict | None = None) -> list | None:
    """The tools a chat template is shown: the checked tools with every tool_choice, so a
    conversation keeps one prompt prefix (and its prefix-cache blocks) from a turn that
    may call to one that must answer. None without tools, and with "none" where the
    template refuses tools (the built-in Llama 3 format): a reply that calls nothing
    needs none shown, and the request stays a plain chat."""
    if not tools:
        return None
    if tool_choice == "none" and tokenizer.tools_refusal(tools, chat_template,
                                                         template_kwargs) is not None:
        return None
    return tools


def check_tools(tools, field: str = "tools") -> list[dict]:
    """OpenAI's tools: [{"type": "function", "function": {"name", "description",
    "parameters" (a JSON schema), "strict"}}]. Returns them as they are (the chat template
    gets them so); RequestError naming the field otherwise."""
    if tools is None:
        return []
    if not isinstance(tools, (list, tuple)):
        raise RequestError(f"{field} must be a list of {{\"type\": \"function\", \"function\": "
                           f"{{...}}}} objects, got {type(tools).__name__}")
    names = set()
    for i, tool in enumerate(tools):
        where = f"{field}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise RequestError(f"{where}.type must be \"function\" (the only kind of tool "
                               f"supported)")
        _check_function(tool.get("function"), f"{where}.function", names)
    return list(tools)


def _check_function(function, where: str, names: set) -> None:
    """One function of tools or functions: {"name", "description", "parameters"}, its name
    not in names (the ones before it), to which it is added."""
    if not isinstance(function, dict):
        raise RequestError(f"{where} must be an object with a name")
    name = function.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
        raise RequestError(f"{where}.name must be 1 to 64 letters, digits, underscores or "
                           f"dashes, got {name!r}")
    if name in names:
        raise RequestError(f"{where}.name {name!r} is given twice; tool names must differ")
    names.add(name)
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise RequestError(f"{where}.description must be a string")
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise RequestError(f"{where}.parameters must be a JSON schema (an object), got "
                               f"{type(parameters).__name__}")
        try:
            json.dumps(parameters, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise RequestError(f"{where}.parameters cannot be written as JSON ({e})") from None
        kind = parameters.get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            raise RequestError(f"{where}.parameters must describe an object (a call's "
                               f"arguments are a JSON object), got \"type\": {json.dumps(kind)}")


def tools_of_functions(functions, field: str = "functions") -> list[dict]:
    """OpenAI's deprecated `functions` ([{"name", "description", "parameters"}]), checked
    as tools are, as the tools they stand for."""
    if functions is None:
        return []
    if isinstance(functions, (str, bytes)) or not isinstance(functions, (list, tuple)):
        raise RequestError(f"{field} must be a list of {{\"name\": ..., \"parameters\": "
                           f"{{...}}}} objects, got {type(functions).__name__}")
    names = set()
    for i, function in enumerate(functions):
        _check_function(function, f"{field}[{i}]", names)
    return [{"type": "function", "function": function} for function in functions]


def tool_choice_of_function_call(function_call, tools: list[dict],
                                 field: str = "function_call"):
    """OpenAI's deprecated `function_call` ("none", "auto" or {"name": N} for one of the
    functions) as the tool_choice it stands for. Left out: "auto" with functions, "none"
    without, as OpenAI does; without functions, "auto" has nothing to call ("none")."""
    if function_call in (None, "auto"):
        return "auto" if tools else "none"
    if function_call == "none":
        return "none"
    name = function_call.get("name") if isinstance(function_call, dict) else None
    if not isinstance(name, str):
        shown = function_call if isinstance(function_call, str) else type(function_call).__name__
        raise RequestError(f"{field} must be \"none\", \"auto\" or {{\"name\": ...}} naming one "
                           f"of the functions, got {shown!r}")
    names = [tool["function"]["name"] for tool in tools]
    if name not in names:
        listed = ", ".join(names) if names else "none are given"
        raise RequestError(f"{field}.name {name!r} is not one of the functions ({listed})")
    return {"type": "function", "function": {"name": name}}


def check_tool_choice(tool_choice, tools: list[dict], field: str = "tool_choice"):
    """"none", "auto", "required", or {"type": "function", "function": {"name": N}} for a
    tool in tools. Left out: "auto" with tools, "none" without (as OpenAI does). "auto"
    without tools is "none": no function can be called, so the reply is plain (clients
    that always send tool_choice send it with no tools too)."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise RequestError(f"{field} must be one of {', '.join(TOOL_CHOICES)} or "
                               f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                               f"got {tool_choice!r}")
        if tool_choice == "required" and not tools:
            raise RequestError(f"{field} is \"required\" but no tools are given")
        return tool_choice if tools else "none"
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(tool_choice, dict) or tool_choice.get("type") != "function"
            or not isinstance(function, dict) or not isinstance(function.get("name"), str)):
        raise RequestError(f"{field} must be one of {', '.join(TOOL_CHOICES)} or "
                           f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    names = [tool["function"]["name"] for tool in tools]
    if function["name"] not in names:
        listed = ", ".join(names) if names else "none are given"
        raise RequestError(f"{field}.function.name {function['name']!r} is not one of the "
                           f"tools ({listed})")
    return {"type": "function", "function": {"name": function["name"]}}


def tool_call_grammar(parser_name: str, tools: list[dict], tool_choice,
                      parallel_tool_calls: bool | None = True,
                      token_id=None) -> StructuredSpec | None:
    """The constraint that enforces tool_choice (checked by check_tool_choice) in the
    format of parser_name; None where nothing is enforced ("auto" or "none").
    parallel_tool_calls false, or a named function: exactly one call, else one or more.
    token_id: text -> the id of the tokenizer's token spelled so, or None (a
    Tokenizer's token_to_id): a format's tags are written as those tokens where the
    tokenizer has them, as the model writes them."""
    check_parser_name(parser_name)
    if tool_choice in (None, "none", "auto"):
        return None
    functions = enforced_functions(tools, tool_choice)
    token_id = token_id or (lambda text: None)
    # a named function is called once, as OpenAI's forced function is
    many = parallel_tool_calls is not False and not isinstance(tool_choice, dict)
    lark = _GRAMMARS[parser_name](functions, many, token_id)
    # what can fail to compile here is a tool's parameters schema: the source names them
    return StructuredSpec.grammar(lark, "tools (the parameters schemas tool_choice enforces)")


def enforced_functions(tools: list[dict], tool_choice, field: str = "tools") -> list[dict]:
    """The functions a tool_choice of "required" (all) or naming a function (that one)
    holds the reply to, each one's parameters schema checked: RequestError naming
    field[i] where llguidance (when installed: without it, the compile says what to
    install) does not take it. Checked alone, the schema is the one its tool gave."""
    functions = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        if isinstance(tool_choice, dict) and function["name"] != tool_choice["function"]["name"]:
            continue
        try:
            text = json.dumps(function.get("parameters") or _NO_PARAMETERS, sort_keys=True)
        except (TypeError, ValueError):
            text = None  # not JSON: check_tools refuses it
        message = text and _schema_error(text)
        if message:
            raise RequestError(f"{field}[{i}].function.parameters: the JSON schema does not "
                               f"compile: {message}")
        functions.append(function)
    return functions


@functools.lru_cache(maxsize=256)
def _schema_error(schema_text: str) -> str:
    """llguidance's one-line message on a JSON schema, "" where it compiles or llguidance
    is not installed (0.2 to 0.4 ms a schema: cached by its text)."""
    try:
        from llguidance import LLMatcher
    except ImportError:
        return ""
    spec = StructuredSpec.json(schema_text, "tools")
    message = LLMatcher.validate_grammar(spec.llguidance_grammar())
    return compiler_message(message, "json") if message else ""


# ---- the formats ------------------------------------------------------------------------

def _calls_schema(functions: list[dict], arguments_key: str) -> dict:
    """Any one of the calls, each a JSON object of its name and then its arguments
    (llguidance writes properties in the schema's order, as the families write them).
    Each function's parameters move to the root's $defs, and references inside them
    follow: a schema's "$ref": "#/$defs/..." means its own root, which is no longer the
    root here (pydantic writes such references)."""
    calls, defs = [], {}
    for i, function in enumerate(functions):
        parameters = _arguments_schema(function)
        own = f"tool_{i}"
        moved = {key: value for key, value in parameters.items()
                 if key not in ("$defs", "definitions")}
        for section in ("$defs", "definitions"):
            for name, schema in (parameters.get(section) or {}).items():
                defs[f"{own}_{section.strip('$')}_{name}"] = _rebased(schema, own)
        defs[own] = _rebased(moved, own)
        calls.append({"type": "object",
                      "properties": {"name": {"const": function["name"]},
                                     arguments_key: {"$ref": f"#/$defs/{own}"}},
                      "required": ["name", arguments_key], "additionalProperties": False})
    return {"anyOf": calls, "$defs": defs}


def _arguments_schema(function: dict) -> dict:
    """The schema a call's arguments follow: the function's parameters, always an object
    (a schema without "type", or of several types among them object, would also let the
    grammar write a number or a string, which no call's arguments are)."""
    parameters = function.get("parameters") or _NO_PARAMETERS
    return {**parameters, "type": "object"}


def _rebased(schema, own: str):
    """schema with its references into its own root pointed at its place in $defs, and
    without $id: an $id there would make itself the base those references resolve
    against, where the pointers now lead from the combined schema's root."""
    if isinstance(schema, list):
        return [_rebased(item, own) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved = {key: _rebased(value, own) for key, value in schema.items() if key != "$id"}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        parts = ref[1:].split("/")  # "", then the pointer's tokens
        if len(parts) >= 3 and parts[1] in ("$defs", "definitions"):
            name = _unescape(parts[2])
            parts = ["", "$defs", _escape(f"{own}_{parts[1].strip('$')}_{name}")] + parts[3:]
        else:
            parts = ["", "$defs", own] + parts[1:]
        moved["$ref"] = "#" + "/".join(parts).rstrip("/")
    return moved


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _json(schema: dict) -> str:
    """A %json terminal: the schema, JSON whitespace bounded as in structured outputs."""
    return "%json " + json.dumps({"x-guidance": {"whitespace_pattern": JSON_WHITESPACE},
                                  **schema}, ensure_ascii=False)


def _tag(text: str, token_id) -> str:
    """A format's tag: the token the tokenizer has for it (llguidance takes every added
    token spelled <...> for a special one, which a string terminal never matches), else
    the text."""
    found = token_id(text)
    return f"<[{found}]>" if found is not None else json.dumps(text)


def _repeat(rule: str, separator: str, many: bool) -> str:
    return f"{rule} ({separator} {rule})*" if many else rule


def _llama3_json(functions, many, token_id) -> str:
    """{"name": ..., "parameters": {...}}, several joined by "; "."""
    calls = _calls_schema(functions, "parameters")
    return "\n".join([f"start: {_repeat('call', json.dumps('; '), many)}",
                      f"call: {_json(calls)}"])


def _hermes(functions, many, token_id) -> str:
    """<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one a line."""
    calls = _calls_schema(functions, "arguments")
    return "\n".join([f"start: {_repeat('call', json.dumps(chr(10)), many)}",
                      f"call: {_tag('<tool_call>', token_id)} \"\\n\" body \"\\n\" "
                      f"{_tag('</tool_call>', token_id)}",
                      f"body: {_json(calls)}"])


def _mistral(functions, many, token_id) -> str:
    """With [ARGS] in the vocabulary (v11 and later): [TOOL_CALLS]name[ARGS]{...} per call;
    before it, [TOOL_CALLS] and one JSON list of {"name", "arguments"} objects."""
    opener = _tag("[TOOL_CALLS]", token_id)
    if token_id("[ARGS]") is not None:
        arguments = _tag("[ARGS]", token_id)
        rules = [f"start: {'call+' if many else 'call'}",
                 "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
        rules += [f"call_{i}: {opener} {json.dumps(f['name'])} {arguments} "
                  f"{_json(_arguments_schema(f))}"
                  for i, f in enumerate(functions)]
        return "\n".join(rules)
    calls = _calls_schema(functions, "arguments")
    schema = {"type": "array", "items": {"anyOf": calls["anyOf"]}, "minItems": 1,
              "$defs": calls["$defs"]}
    if not many:
        schema["maxItems"] = 1
    return "\n".join([f"start: {opener} \" \"? calls", f"calls: {_json(schema)}"])


_GRAMMARS = {"llama3_json": _llama3_json, "hermes": _hermes, "mistral": _mistral}
assert set(_GRAMMARS) == set(PARSER_NAMES)
