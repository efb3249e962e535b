"""Messages for invalid structured input: pydantic errors as one line per key path, with the
nearest valid key (params.yaml, a backend's SKU options, a device inventory)."""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Union, get_args

from pydantic import BaseModel, ValidationError


def did_you_mean(word: object, choices: Any) -> str:
    """' (did you mean X?)' with the closest of ``choices``, or nothing."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _fields_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Valid keys of the pydantic model found by walking ``loc`` from ``model``."""
    current: Any = model
    for part in loc:
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(str(part))
            if field is None:
                return []
            current = field.annotation
        else:
            current = _container_value(current)
        current = _unwrap(current)
    return list(current.model_fields) if isinstance(current, type) and issubclass(current, BaseModel) else []


def _unwrap(tp: Any) -> Any:
    args = [a for a in get_args(tp) if a is not type(None)]
    if getattr(tp, "__origin__", None) is Union or type(tp).__name__ == "UnionType":
        return _unwrap(args[0]) if len(args) == 1 else tp
    if getattr(tp, "__origin__", None) is Annotated:
        return _unwrap(args[0])
    return tp


def _container_value(tp: Any) -> Any:
    args = get_args(tp)
    return args[-1] if args else Any


def validation_problems(exc: ValidationError, model: type[BaseModel], prefix: tuple[Any, ...] = ()) -> list[str]:
    """One line per pydantic error: the full key path, what is wrong, the nearest valid key."""
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in (*prefix, *loc)) or "(top level)"
        if err["type"] == "extra_forbidden":
            valid = _fields_at(model, loc[:-1])
            known = f"; valid keys here: {', '.join(valid)}" if valid else ""
            lines.append(f"{key}: unknown key{did_you_mean(loc[-1], valid)}{known}")
        elif err["type"] == "literal_error":
            expected = re.findall(r"'([^']*)'", str(err.get("ctx", {}).get("expected", "")))
            lines.append(f"{key}: {err['msg']} (got {err['input']!r}){did_you_mean(err['input'], expected)}")
        elif (
            err["type"] == "missing"
            and len(loc) == 1
            and model.model_fields.get(str(loc[0])) is not None
            and model.model_fields[str(loc[0])].description
        ):
            lines.append(f"{key}: missing; {model.model_fields[str(loc[0])].description}")
        else:
            lines.append(f"{key}: {err['msg'].removeprefix('Value error, ')}")
    return lines
