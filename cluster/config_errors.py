"""Turning msgspec validation errors into config errors that name the YAML path.

msgspec reports ``Invalid enum value 'diagonal' - at `$.placement.strategy```; a user
should read ``placement.strategy: expected one of contiguous, round_robin, explicit; got
'diagonal'``. The expected values come from the field's type annotation, found by walking
the Struct types along the path; the offending value comes from the raw YAML data.
"""

from __future__ import annotations

import enum
import re
import types
import typing
from typing import Any

import msgspec


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the YAML path."""


_MISSING = object()
_ANY_KEY = object()  # msgspec writes `[...]` for a value inside a dict, without its key
_PATH_TOKEN = re.compile(r"\.(\w+)|\[(\.\.\.|\d+)\]")
_AT = re.compile(r"^(?P<text>.*?)(?: - at (?:`key` in )?`(?P<path>\$[^`]*)`)?$", re.S)


def describe_validation_error(
    error: msgspec.ValidationError, data: Any, root_type: type
) -> str:
    """``path: expected ...; got ...`` for one msgspec error over ``data`` (YAML builtins)."""
    match = _AT.match(str(error))
    text, raw_path = match["text"], match["path"] or "$"
    is_key_error = " - at `key` in " in str(error)
    tokens = _parse_path(raw_path)
    path, field_type, value = _walk(root_type, data, tokens)

    unknown = re.match(r"Object contains unknown field `(.+)`", text)
    if unknown:
        section = _strip(field_type)  # (an optional section too)
        known = ", ".join(_struct_fields(section)) if _is_struct(section) else ""
        allowed = f"; allowed fields: {known}" if known else ""
        return f"{_join(path, unknown[1])}: unknown field{allowed}"
    missing = re.match(r"Object missing required field `(.+)`", text)
    if missing:
        return f"{_join(path, missing[1])}: required field is missing"
    if is_key_error:
        key_type = typing.get_args(_strip(field_type))[0]
        bad = next((k for k in value if not _converts(k, key_type)), _MISSING)
        return f"{path}: expected each key to be {describe_type(key_type)}; got {_show(bad)}"
    if field_type is _MISSING:
        return f"{path or '<top level>'}: {text[:1].lower()}{text[1:]}"
    return f"{path or '<top level>'}: expected {describe_type(field_type)}; got {_show(value)}"


def describe_type(tp: Any) -> str:
    """Plain words for a field type: ``one of a, b``, ``an integer >= 1``, ``a mapping``."""
    tp, metas = _unwrap_annotated(tp)
    args = typing.get_args(tp)
    if _is_union(tp):
        members = [a for a in args if a is not type(None)]
        words = " or ".join(describe_type(a) for a in members)
        return f"{words} or null" if len(members) < len(args) else words
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(str(m.value) for m in tp)
    if tp is bool:
        return "true or false"
    if tp in (int, float):
        noun = "an integer" if tp is int else "a number"
        return noun + _bounds(metas)
    if tp is str:
        return "a string"
    if _is_struct(tp) or typing.get_origin(tp) is dict or tp is dict:
        return "a mapping"
    if typing.get_origin(tp) is list or tp is list:
        return "a list"
    return getattr(tp, "__name__", str(tp))


def _bounds(metas: list[msgspec.Meta]) -> str:
    ge = next((m.ge for m in metas if m.ge is not None), None)
    le = next((m.le for m in metas if m.le is not None), None)
    gt = next((m.gt for m in metas if m.gt is not None), None)
    lt = next((m.lt for m in metas if m.lt is not None), None)
    if ge is not None and le is not None:
        return f" in {ge}..{le}"
    if ge is not None and lt is not None:
        return f" >= {ge} and < {lt}"
    if ge is not None:
        return f" >= {ge}"
    if gt is not None:
        return f" > {gt}"
    return ""


def _parse_path(raw: str) -> list[Any]:
    tokens: list[Any] = []
    for name, index in _PATH_TOKEN.findall(raw[1:]):
        if name:
            tokens.append(name)
        else:
            tokens.append(_ANY_KEY if index == "..." else int(index))
    return tokens


def _walk(root_type: type, data: Any, tokens: list[Any]) -> tuple[str, Any, Any]:
    """The YAML path, field type and raw value at msgspec's path (``_MISSING`` if lost)."""
    path, tp, value = "", root_type, data
    for token in tokens:
        tp = _strip(tp)
        is_index = typing.get_origin(tp) is list
        if _is_struct(tp):
            tp = typing.get_type_hints(tp, include_extras=True).get(token, _MISSING)
        elif typing.get_origin(tp) in (dict, list):
            tp = typing.get_args(tp)[-1]
        else:
            tp = _MISSING
        if token is _ANY_KEY and isinstance(value, dict):
            # The first entry whose value does not convert is the one msgspec reported.
            token = next((k for k, v in value.items() if not _converts(v, tp)), _ANY_KEY)
        if is_index:
            path = f"{path}[{token}]"
        else:
            path = _join(path, "..." if token is _ANY_KEY else token)
        try:
            value = value[token]
        except (KeyError, IndexError, TypeError):
            value = _MISSING
    return path, tp, value


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _converts(value: Any, tp: Any) -> bool:
    try:
        msgspec.convert(value, tp, strict=True)
    except (msgspec.ValidationError, TypeError):
        return False
    return True


def _unwrap_annotated(tp: Any) -> tuple[Any, list[msgspec.Meta]]:
    if typing.get_origin(tp) is typing.Annotated:
        base, *extras = typing.get_args(tp)
        return base, [m for m in extras if isinstance(m, msgspec.Meta)]
    return tp, []


def _strip(tp: Any) -> Any:
    """The type under Annotated and Optional: what the next path token indexes into."""
    tp, _ = _unwrap_annotated(tp)
    if _is_union(tp):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(members) == 1:
            return _strip(members[0])
    return tp


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _struct_fields(tp: type) -> list[str]:
    return [f.name for f in msgspec.structs.fields(tp)]


def _show(value: Any) -> str:
    if value is _MISSING:
        return "something else"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
