"""Reading YAML files and turning pydantic errors into one line a user can act on."""

from __future__ import annotations

import typing
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from hexiseq.errors import InputError


def read_yaml_file(path: str | Path, what: str) -> Any:
    """Parse a YAML file; raise `InputError` naming the file if it is missing or malformed."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{what} file {path}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{what} file {path}: not UTF-8 text (byte {exc.start}); save it as UTF-8 YAML"
        ) from None
    try:
        return yaml.safe_load(text)
    except RecursionError:
        raise InputError(
            f"{what} file {path}: nested too deeply (or an alias that refers to itself)"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid syntax"
        raise InputError(f"{what} file {path}: not valid YAML{where}: {problem}") from None


PACKAGED_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""The loader of hexiseq's own YAML files: libyaml's safe loader where PyYAML has it (the GPU
catalog parses in 6 ms instead of 60, on every start of the CLI), else PyYAML's. The same
documents either way; a user's files keep PyYAML's loader and its error messages."""


def read_packaged_yaml(name: str) -> Any:
    """Parse a YAML file shipped in `hexiseq/data/`."""
    text = resources.files("hexiseq").joinpath("data", name).read_text("utf-8")
    return yaml.load(text, Loader=PACKAGED_LOADER)


def format_validation_error(
    exc: ValidationError, source: str, root: type[BaseModel] | None = None
) -> str:
    """First error of a pydantic `ValidationError` as `source: field.path: message`.

    With `root` (the validated model class), an unknown key's message lists the allowed keys.
    """
    # An unknown key explains most other errors of its mapping (a misspelt field is also
    # "missing"), so it is reported first.
    error = min(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    location = _format_location(error["loc"])
    message = _explain(error, root)
    prefix = f"{source}: {location}: " if location else f"{source}: "
    more = len(exc.errors()) - 1
    suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    return f"{prefix}{message}{suffix}"


def _format_location(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif not str(part).startswith("function-"):
            text += f".{part}" if text else str(part)
    return text


def _explain(error: dict[str, Any], root: type[BaseModel] | None) -> str:
    kind = error["type"]
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        owner = _model_at(root, error["loc"][:-1]) if root else None
        allowed = f"; allowed keys: {', '.join(owner.model_fields)}" if owner else ""
        return "unknown key" + allowed
    message = str(error["msg"]).removeprefix("Value error, ")
    if kind.startswith("value_error") or kind.startswith("assertion"):
        return message
    return f"{message[0].lower()}{message[1:]} (got {error.get('input')!r})"


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class found by following `loc` from `model` (lists and optionals)."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        field = current.model_fields.get(part) if _is_model(current) else None
        if field is None:
            return None
        current = _unwrap(field.annotation)
    return current if _is_model(current) else None


def _unwrap(annotation: Any) -> Any:
    """`list[X]`, `X | None` -> X (the first model class inside), else the annotation."""
    for arg in typing.get_args(annotation):
        inner = _unwrap(arg)
        if _is_model(inner):
            return inner
    return annotation


def _is_model(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseModel)
