"""What xgrammar would silently misread in a constraint (schema keywords it ignores, regex syntax it
reads unlike ``re``), refused by name before it compiles."""
from __future__ import annotations

import json
import re

MAX_DEPTH = 64  # schema levels: real schemas stay far below
TOO_DEEP = f"structured_outputs.json is nested more than {MAX_DEPTH} levels deep"
# the string formats xgrammar has a grammar for; any other it takes for a plain string
FORMATS = frozenset("email date time date-time duration ipv4 ipv6 hostname uuid uri uri-reference "
                    "uri-template json-pointer relative-json-pointer".split())
IGNORED = ("not", "if", "then", "else", "contains", "minContains", "maxContains",
           "dependentRequired", "dependentSchemas", "dependencies",
           "$dynamicRef")  # wherever they are
# a schema holding one of these is compiled from the first alone
EXCLUSIVE = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
# ignored unless `type` says which values they constrain
UNTYPED = ("minLength", "maxLength", "pattern", "format", "minimum", "maximum",
           "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minItems", "maxItems",
           "minProperties", "maxProperties")
LENGTHS = frozenset(("minLength", "maxLength"))
# keywords holding a schema, a map of them, a list of them
ONE = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
       "propertyNames")
MAP = ("properties", "patternProperties", "$defs", "definitions")
LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
CONSTRAINTS = frozenset(("type", "uniqueItems", "required") + UNTYPED + EXCLUSIVE + ONE + MAP[:2]
                        + LIST)
# a raw JSON string character: no quote, backslash, control or surrogate (as ranges, so that
# xgrammar refuses overlong UTF-8 too; no escapes: its patterns miss them in alternations)
JSON_CHAR = r'[ !#-\[\]-\ud7ff\ue000-\U0010ffff]'
# the letter escapes xgrammar reads as re does; it takes any other for the letter
KNOWN_ESCAPE = re.compile(r"[afnrtvdDwWsScbBpPk]|x[0-9a-fA-F]{2}|"
                          r"u([0-9a-fA-F]{4}|\{[0-9a-fA-F]+\})")
_TYPES = {str: "string", list: "array", dict: "object", type(None): "null", bool: "boolean"}


def checked_schema(schema, root=None, path: str = "", depth: int = 0):
    """``schema`` as xgrammar should compile it, or a ``ValueError`` naming a keyword it would
    ignore, and where."""
    if depth > MAX_DEPTH:
        raise ValueError(TOO_DEEP)
    if not isinstance(schema, dict):
        return schema
    root = schema if root is None else root
    if problem := _ignored(schema, root) or _untyped(schema):
        raise ValueError(f"structured_outputs.json: {problem} at {path or 'the root'} "
                         "is not supported")

    def checked(value, where):
        return checked_schema(value, root, f"{path}.{where}".lstrip("."), depth + 1)
    out = dict(schema)
    # a property name is a string: its keywords apply
    if isinstance(out.get("propertyNames"), dict):
        out["propertyNames"] = {"type": "string"} | out["propertyNames"]
    for key in ONE:
        if key in out:
            out[key] = checked(out[key], key)
    for key in MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: checked(value, f"{key}.{name}") for name, value in out[key].items()}
    for key in LIST:
        if isinstance(out.get(key), list):
            out[key] = [checked(value, f"{key}.{i}") for i, value in enumerate(out[key])]
    return _length_as_pattern(out)


def _ignored(schema: dict, root: dict) -> str | None:
    """A keyword xgrammar ignores anywhere, beside others, or in a form it cannot enforce."""
    if key := next((key for key in IGNORED if key in schema), None):
        return repr(key)
    if schema.get("uniqueItems") is True:
        return "'uniqueItems'"
    first = next((key for key in EXCLUSIVE if key in schema), None)
    beside = [key for key in schema if key in CONSTRAINTS and key != first
              and not (key == "type" and first in ("const", "enum") and _values_typed(schema))]
    if first and beside:
        return f"{beside[0]!r} beside {first!r}"
    ref, branches = schema.get("$ref"), schema.get("allOf")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        return f"'$ref' to {ref!r}"
    if isinstance(branches, list) and len(branches) > 1:
        return f"'allOf' of {len(branches)} schemas"
    if isinstance(schema.get("oneOf"), list) and not _disjoint(schema["oneOf"], root):
        return "'oneOf' whose branches may overlap"
    properties, patterns = schema.get("properties"), schema.get("patternProperties")
    names = properties if isinstance(properties, dict) else {}
    if missing := [name for name in _names(schema.get("required")) if name not in names]:
        return f"'required' naming {missing[0]!r}, which is not under 'properties',"
    if key := next((key for key in ("properties", "patternProperties") if key in schema), None):
        if "propertyNames" in schema:
            return f"'propertyNames' beside {key!r}"
    if isinstance(patterns, dict) and "properties" in schema:
        return "'patternProperties' beside 'properties'"
    if isinstance(patterns, dict) and len(patterns) > 1:
        return "more than one pattern in 'patternProperties'"
    return None


def _untyped(schema: dict) -> str | None:
    """A keyword xgrammar ignores for want of a ``type``, or of the right one."""
    types = _types(schema)
    if "type" not in schema and not any(key in schema for key in EXCLUSIVE):
        if key := next((key for key in UNTYPED if key in schema), None):
            return f"{key!r} without 'type'"
    step = schema.get("multipleOf")
    if step is not None and ("number" in types or not isinstance(step, (int, float))
                             or not float(step).is_integer()):
        return "'multipleOf'"  # xgrammar enforces an integer one on integers only
    if "string" not in types:
        return None
    if isinstance(schema.get("format"), str) and schema["format"] not in FORMATS:
        return f"'format': {schema['format']!r}"
    length = sorted(schema.keys() & LENGTHS)
    other = next((key for key in ("pattern", "format") if key in schema), None)
    return f"{length[0]!r} beside {other!r}" if length and other else None


def _length_as_pattern(schema: dict) -> dict:
    """A length-limited string as a pattern: xgrammar's own grammar for lengths admits raw control
    characters."""
    lo, hi = schema.get("minLength", 0), schema.get("maxLength", "")
    if not (schema.keys() & LENGTHS and "string" in _types(schema) and "pattern" not in schema
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                    for n in (lo, hi or 0))):
        return schema
    out = {key: value for key, value in schema.items() if key not in LENGTHS}
    return out | {"pattern": f"^{JSON_CHAR}{{{lo},{hi}}}$"}


def _types(schema: dict) -> set:
    kind = schema.get("type")
    return {kind} if isinstance(kind, str) else set(_names(kind))


def _names(value) -> list:
    """The strings of a list keyword; a malformed one is left to xgrammar."""
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _values(schema) -> list | None:
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    return values if isinstance(values, list) else None


def _values_typed(schema: dict) -> bool:
    """Whether every ``const`` or ``enum`` value has the schema's ``type`` (which xgrammar
    ignores)."""
    def types(value):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return {"number", "integer"} if float(value).is_integer() else {"number"}
        return {_TYPES.get(type(value))}
    values = _values(schema)
    return values is not None and all(types(v) & _types(schema) for v in values)


def _consts(schema) -> set | None:
    """A ``const`` or ``enum``'s values as JSON texts, 1 and 1.0 alike (as JSON Schema holds
    them)."""
    def number(text):
        return int(float(text)) if float(text).is_integer() else float(text)
    values = _values(schema) if isinstance(schema, dict) else None
    if values is None:
        return None
    return {json.dumps(json.loads(json.dumps(v), parse_float=number), sort_keys=True)
            for v in values}


def _deref(schema, root: dict):
    """A local ``$ref``'s target (one level), else ``schema``."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if not (isinstance(ref, str) and ref.startswith("#")):
        return schema
    for part in filter(None, ref[1:].split("/")):
        root = (root.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(root, dict)
                else None)
    return root


def _apart(groups: list) -> bool:
    """Whether every group is known (not None) and no two share a member."""
    return all(g is not None for g in groups) and len(set().union(*groups)) == sum(map(len, groups))


def _disjoint(branches: list, root: dict) -> bool:
    """Whether no value can match two ``oneOf`` branches (xgrammar reads it as ``anyOf``): by their
    values, their types (integer counts as number), or a required property's values."""
    branches = [_deref(b, root) for b in branches]
    if not all(isinstance(b, dict) for b in branches):
        return False
    types = [{"number" if t == "integer" else t for t in _types(b)} or None for b in branches]
    if _apart([_consts(b) for b in branches]) or _apart(types):
        return True
    common = set.intersection(*(set(_names(b.get("required"))) for b in branches))
    return any(_apart([_consts(_deref((b.get("properties") or {}).get(key), root))
                       for b in branches]) for key in common)


def check_regex(regex: str) -> None:
    """A ``ValueError`` naming what xgrammar would misread in ``regex``, or a class matching
    nothing."""
    def refuse(what, why=""):
        raise ValueError(f"structured_outputs.regex: {what} is not supported{why}")
    start, escapes = None, set()  # the character class being read: where it began, its escapes
    for token in re.finditer(r"\\.|.", regex, re.S):
        i, text = token.start(), token.group()
        if len(text) == 2:
            if text[1].isalpha() and not KNOWN_ESCAPE.match(regex, i + 1):
                refuse(f"{text!r} at position {i}")
            if text == "\\^" and start == i - 1:
                refuse(f"{text!r} first in a character class at position {i}")
            escapes.add(text[1])
        elif start is None and text in "^$" and i != (0 if text == "^" else len(regex) - 1):
            refuse(f"{text!r} at position {i}",
                   f" (only at the {'start' if text == '^' else 'end'})")
        elif start is None and text == "[":
            start, escapes = i, set()
        elif start is not None and text == "]" and i > start + 1 + (regex[start + 1] == "^"):
            if regex[start + 1] == "^" and any({a, a.upper()} <= escapes for a in "sdw"):
                raise ValueError("structured_outputs.regex matches no string: "
                                 f"{regex[start:i + 1]!r} at position {start} matches no character")
            start = None
