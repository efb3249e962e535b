"""Messages for invalid structured input: pydantic errors as one line per key path, with the
nearest valid key (params.yaml, a backend's SKU options, a device inventory)."""

from __future__ import annotations

import difflib
import re
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, Tag, ValidationError


def did_you_mean(word: object, choices: Any) -> str:
    """' (did you mean X?)' with the closest of ``choices``, or nothing."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _walk(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], list[str]]:
    """``loc`` without the tags a tagged union (pydantic's Discriminator) adds to it, and the valid keys
    of the pydantic model found by walking it from ``model`` (none where the walk gets lost)."""
    current: Any = model
    shown: list[Any] = []
    for part in loc:
        member = _tagged(current).get(part) if isinstance(part, str) else None
        if member is not None:  # the form the discriminator chose: not a key of the file
            current = member
            continue
        shown.append(part)
        bare = _unwrap(current)
        if isinstance(bare, type) and issubclass(bare, BaseModel):
            field = bare.model_fields.get(str(part))
            current = field.annotation if field is not None else None
        else:
            current = _container_value(bare)
    bare = _unwrap(current)
    valid = list(bare.model_fields) if isinstance(bare, type) and issubclass(bare, BaseModel) else []
    return tuple(shown), valid


def _tagged(tp: Any) -> dict[str, Any]:
    """A tagged union's members by tag (``Annotated[X, Tag(...)]`` members), else nothing."""
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    members = {}
    for member in get_args(tp) if get_origin(tp) in (Union, UnionType) else ():
        tag = next((m.tag for m in getattr(member, "__metadata__", ()) if isinstance(m, Tag)), None)
        if tag is not None:
            members[tag] = member
    return members


def _unwrap(tp: Any) -> Any:
    args = [a for a in get_args(tp) if a is not type(None)]
    if get_origin(tp) in (Union, UnionType):
        return _unwrap(args[0]) if len(args) == 1 else tp
    if get_origin(tp) is Annotated:
        return _unwrap(args[0])
    return tp


def _container_value(tp: Any) -> Any:
    args = get_args(tp)
    return args[-1] if args else Any


def validation_problems(exc: ValidationError, model: type[BaseModel], prefix: tuple[Any, ...] = ()) -> list[str]:
    """One line per pydantic error: the full key path, what is wrong, the nearest valid key."""
    lines = []
    for err in exc.errors():
        loc, _ = _walk(model, tuple(err["loc"]))
        key = ".".join(str(p) for p in (*prefix, *loc)) or "(top level)"
        if err["type"] == "extra_forbidden":
            valid = _walk(model, tuple(err["loc"])[:-1])[1]
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
