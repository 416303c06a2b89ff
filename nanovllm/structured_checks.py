"""What xgrammar would silently misread in a structured-output constraint, refused by name before it compiles:
JSON-schema keywords its converter ignores (found by compiling each and sampling what the grammar accepts) and
regex syntax its converter reads differently from Python's ``re``. Length-limited strings are rewritten into a
pattern of JSON-legal characters, because xgrammar's own grammar for them admits raw control characters."""
from __future__ import annotations

import json
import re

MAX_DEPTH = 64  # schema levels (a property, an item, a branch ...): real schemas stay far below
# the string formats xgrammar has a grammar for; any other it takes for a plain string
FORMATS = frozenset("email date time date-time duration ipv4 ipv6 hostname uuid uri uri-reference uri-template "
                    "json-pointer relative-json-pointer".split())
IGNORED = ("not", "if", "then", "else", "contains", "minContains", "maxContains", "dependentRequired",
           "dependentSchemas", "dependencies", "$dynamicRef")  # wherever they are
# a schema holding one of these is compiled from the first alone: every other constraint beside it is ignored
EXCLUSIVE = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
CONSTRAINTS = frozenset(
    "type enum const multipleOf maximum exclusiveMaximum minimum exclusiveMinimum maxLength minLength pattern format "
    "items prefixItems unevaluatedItems maxItems minItems uniqueItems properties patternProperties "
    "additionalProperties unevaluatedProperties propertyNames maxProperties minProperties required allOf anyOf oneOf "
    "$ref".split())
# ignored unless `type` says which values they constrain
UNTYPED = ("minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
           "multipleOf", "minItems", "maxItems", "minProperties", "maxProperties")
SUBSCHEMAS = {"items": 1, "additionalProperties": 1, "unevaluatedProperties": 1, "unevaluatedItems": 1,
              "propertyNames": 1, "properties": 2, "patternProperties": 2, "$defs": 2, "definitions": 2,
              "prefixItems": 3, "anyOf": 3, "oneOf": 3, "allOf": 3}  # 1: a schema, 2: a map of them, 3: a list
# a JSON string's raw character as valid UTF-8: no quote, backslash, control or surrogate (written as ranges, so
# that xgrammar refuses overlong byte sequences too; escapes are left out: its patterns miss them in alternations)
JSON_CHAR = r'[ !#-\[\]-\ud7ff\ue000-\U0010ffff]'
# escapes xgrammar reads as Python's re does; it takes any other letter for itself (or refuses it by name)
REGEX_ESCAPES = frozenset("afnrtv0dDwWsSxucbBpPk")
_TYPES = {str: "string", list: "array", dict: "object", type(None): "null", bool: "boolean"}


def checked_schema(schema, root=None, path: str = "", depth: int = 0):
    """``schema`` as xgrammar should compile it (length-limited strings as patterns), or a ``ValueError`` naming
    the first keyword xgrammar would ignore and its path in the schema."""
    if depth > MAX_DEPTH:
        raise ValueError(f"structured_outputs.json is nested more than {MAX_DEPTH} levels deep")
    if not isinstance(schema, dict):
        return schema
    root = schema if root is None else root
    _refuse_ignored(schema, root, path or "the root")
    _refuse_untyped(schema, path or "the root")
    out = dict(schema)
    for key, shape in SUBSCHEMAS.items():
        value, where = schema.get(key), f"{path}.{key}".lstrip(".")
        if key == "propertyNames" and isinstance(value, dict):
            value = {"type": "string"} | value  # a property name is a string: its keywords apply
        if shape == 1 and key in schema:
            out[key] = checked_schema(value, root, where, depth + 1)
        elif shape == 2 and isinstance(value, dict):
            out[key] = {k: checked_schema(v, root, f"{where}.{k}", depth + 1) for k, v in value.items()}
        elif shape == 3 and isinstance(value, list):
            out[key] = [checked_schema(v, root, f"{where}.{i}", depth + 1) for i, v in enumerate(value)]
    return _length_as_pattern(out)


def _refuse_ignored(schema: dict, root: dict, path: str) -> None:
    """The keywords xgrammar ignores wherever they are, or beside others, or in the forms it cannot enforce."""
    def refuse(what, why=""):
        raise ValueError(f"structured_outputs.json: {what} at {path} is not supported{why}")
    for key in IGNORED:
        if key in schema:
            refuse(repr(key))
    if schema.get("uniqueItems") is True:
        refuse("'uniqueItems'")
    first = next((key for key in EXCLUSIVE if key in schema), None)
    beside = [key for key in schema if key in CONSTRAINTS and key != first
              and not (key == "type" and first in ("const", "enum") and _values_typed(schema))]
    if first and beside:
        refuse(f"{beside[0]!r} beside {first!r}")
    if isinstance(schema.get("$ref"), str) and not (schema["$ref"] == "#" or schema["$ref"].startswith("#/")):
        refuse(f"'$ref' to {schema['$ref']!r}", " (only '#/...' pointers into the schema)")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        refuse(f"'allOf' of {len(schema['allOf'])} schemas")
    if isinstance(schema.get("oneOf"), list) and not _disjoint(schema["oneOf"], root):
        refuse("'oneOf' whose branches may overlap", " (xgrammar reads it as 'anyOf')")
    names = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    missing = [name for name in _names(schema.get("required")) if name not in names]
    if missing:
        refuse(f"'required' naming {missing[0]!r}, which is not under 'properties',")
    for key in ("properties", "patternProperties"):
        if key in schema and "propertyNames" in schema:
            refuse(f"'propertyNames' beside {key!r}")
    patterns = schema.get("patternProperties")
    if isinstance(patterns, dict) and ("properties" in schema or len(patterns) > 1):
        refuse("'patternProperties' beside 'properties'" if "properties" in schema else "more than one pattern in "
               "'patternProperties'")


def _refuse_untyped(schema: dict, path: str) -> None:
    """The keywords xgrammar ignores for want of a ``type``, or of the right one."""
    types = _types(schema)
    if "type" not in schema and not any(key in schema for key in EXCLUSIVE):
        if key := next((key for key in UNTYPED if key in schema), None):
            raise ValueError(f"structured_outputs.json: {key!r} without 'type' at {path} is not supported")
    step = schema.get("multipleOf")
    if step is not None and ("number" in types or not isinstance(step, (int, float)) or not float(step).is_integer()):
        raise ValueError(f"structured_outputs.json: 'multipleOf' at {path} is not supported (only an integer one "
                         "with type 'integer')")
    if "string" in types and isinstance(schema.get("format"), str) and schema["format"] not in FORMATS:
        raise ValueError(f"structured_outputs.json: 'format': {schema['format']!r} at {path} is not supported "
                         f"(supported: {', '.join(sorted(FORMATS))})")
    for key in ("pattern", "format"):
        if "string" in types and key in schema and (length := {"minLength", "maxLength"} & schema.keys()):
            raise ValueError(f"structured_outputs.json: {sorted(length)[0]!r} beside {key!r} at {path} is not "
                             "supported")


def _length_as_pattern(schema: dict) -> dict:
    """A length-limited string as a pattern of raw JSON characters, each counted once (so such a string holds no
    quote, backslash or control character): xgrammar's grammar for the lengths admits raw control characters."""
    lo, hi = schema.get("minLength", 0), schema.get("maxLength", "")
    if not ({"minLength", "maxLength"} & schema.keys() and "string" in _types(schema) and "pattern" not in schema
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (lo, hi or 0))):
        return schema
    out = {key: value for key, value in schema.items() if key not in ("minLength", "maxLength")}
    return out | {"pattern": f"^{JSON_CHAR}{{{lo},{hi}}}$"}


def _types(schema: dict) -> set:
    kind = schema.get("type")
    return {kind} if isinstance(kind, str) else set(_names(kind))


def _names(value) -> list:
    """The strings of a list keyword (``type``, ``required``); a malformed one is left to xgrammar to refuse."""
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _json_types(value) -> set:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {"number", "integer"} if float(value).is_integer() else {"number"}
    return {_TYPES.get(type(value))}


def _values_typed(schema: dict) -> bool:
    """Whether every ``const`` or ``enum`` value has the schema's ``type`` (xgrammar leaves the type unchecked)."""
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    return isinstance(values, list) and all(_json_types(v) & _types(schema) for v in values)


def _canon(value) -> str:
    """A value's JSON text with integral numbers written alike (JSON Schema holds 1 and 1.0 equal)."""
    def number(text):
        return int(float(text)) if float(text).is_integer() else float(text)
    return json.dumps(json.loads(json.dumps(value), parse_float=number), sort_keys=True)


def _consts(schema) -> set | None:
    if isinstance(schema, dict) and "const" in schema:
        return {_canon(schema["const"])}
    if isinstance(schema, dict) and isinstance(schema.get("enum"), list):
        return {_canon(v) for v in schema["enum"]}
    return None


def _deref(schema, root: dict):
    """A local ``$ref``'s target (one level), else ``schema``."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if not (isinstance(ref, str) and ref.startswith("#")):
        return schema
    for part in filter(None, ref[1:].split("/")):
        root = root.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(root, dict) else None
    return root


def _disjoint(branches: list, root: dict) -> bool:
    """Whether no value can match two ``oneOf`` branches, so that xgrammar's ``anyOf`` is exact: each branch a
    ``const``/``enum`` of values no other has, or of a ``type`` no other has (integer counts as number), or an
    object whose property named in every branch's ``required`` is a different ``const``/``enum``."""
    branches = [_deref(b, root) for b in branches]
    if not all(isinstance(b, dict) for b in branches):
        return False

    def apart(groups):
        return all(g is not None for g in groups) and len(set().union(*groups)) == sum(map(len, groups))
    types = [{"number" if t == "integer" else t for t in _types(b)} or None for b in branches]
    if apart([_consts(b) for b in branches]) or apart(types):
        return True
    common = set.intersection(*(set(_names(b.get("required"))) for b in branches)) if branches else set()
    return any(apart([_consts(_deref((b.get("properties") or {}).get(key), root)) for b in branches])
               for key in sorted(common))


def check_regex(regex: str) -> None:
    """A ``ValueError`` naming what xgrammar's regex converter would misread (it takes ``\\Z``, ``\\A``, ``\\G`` and
    other unknown escapes for the letter, drops a ``^`` or ``$`` inside the regex, takes ``[\\^...]`` for a
    negation), or a character class that matches nothing (``[^\\s\\S]``). The whole output is matched: no anchors
    are needed. Lookarounds, backreferences, flags and possessive quantifiers xgrammar refuses itself."""
    i, start, escapes = 0, None, set()  # start: where the character class being read began; escapes: its \d...
    while i < len(regex):
        c, rest = regex[i], regex[i + 1:]
        if c == "\\" and rest:
            e = rest[0]
            if ((e.isalpha() and e not in REGEX_ESCAPES) or (e == "x" and not re.match(r"[0-9a-fA-F]{2}", rest[1:]))
                    or (e == "u" and not re.match(r"[0-9a-fA-F]{4}|\{[0-9a-fA-F]+\}", rest[1:]))):
                raise ValueError(f"structured_outputs.regex: {regex[i:i + 2]!r} at position {i} is not supported")
            if e == "^" and start == i - 1:
                raise ValueError(f"structured_outputs.regex: {regex[i:i + 2]!r} first in a character class at "
                                 f"position {i} is not supported (xgrammar reads it as a negation)")
            escapes.add(e)
            i += 2
            continue
        if start is None and c in "^$" and i != (0 if c == "^" else len(regex) - 1):
            raise ValueError(f"structured_outputs.regex: {c!r} at position {i} is not supported (only at the "
                             f"{'start' if c == '^' else 'end'}; the whole output is matched)")
        if start is None and c == "[":
            start, escapes = i, set()
        elif start is not None and c == "]" and i > start + 1 + (regex[start + 1] == "^"):
            body, start = regex[start:i + 1], None
            if body.startswith("[^") and any({a, a.upper()} <= escapes for a in "sdw"):
                raise ValueError(f"structured_outputs.regex matches no string: {body!r} at position "
                                 f"{i + 1 - len(body)} matches no character")
        i += 1
