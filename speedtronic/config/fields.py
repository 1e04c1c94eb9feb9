"""Field types and the section decorator: how a config field is declared once.

A field is one line: ``name: Annotated[Int, Field(gt=0, le=..., description=...)] = default``.
The type aliases here (:data:`Int`, :data:`Float`, :data:`Bool`, :data:`Str`, :data:`PathStr`)
carry the coercion rules of SPEC §3 as pydantic ``BeforeValidator`` s, so a wrong type is a
:class:`ConfigError` naming the field and the expected type (never a raw ``TypeError``):

* integers: ``int`` (not ``bool``), integral floats (``4.0``), decimal strings (``"7"``, ``"1e3"``);
* numbers: ``int``/``float`` (not ``bool``) and numeric strings such as ``"3e-4"`` (PyYAML reads
  exponent floats without a decimal point as strings); the result is a finite ``float``;
* booleans: ``bool``, the integers 0/1, the strings true/false/yes/no/on/off/1/0 (any case);
* strings: ``str``, and ``int``/``float`` scalars (``name: 2024``); paths have no NUL byte and
  bounded lengths. A token-shaped value outside ``distributed.token`` is refused, unshown.

:func:`section` makes a class a pydantic dataclass (``dataclasses.fields``/``replace``/``asdict``
keep working) whose errors are :class:`ConfigError` s in one line.
Bounds come from the ``Field`` constraints; :class:`Says` keeps a 2.0.0 wording where the
generic one (``must be positive``, ``cannot be negative``, ``must be at most N``) differs.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import reprlib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic.fields import FieldInfo

from speedtronic.config.errors import ConfigError
from speedtronic.config.limits import MAX_INT_DIGITS, MAX_STEPS, check_path_text
from speedtronic.config.redaction import REDACTED, SecretText, contains_secret, looks_like_token

__all__ = [
    "BETWEEN",
    "STEPS",
    "Bool",
    "F",
    "Float",
    "Int",
    "PathStr",
    "Says",
    "Str",
    "StrList",
    "bounds",
    "choice",
    "describe",
    "number_text",
    "one_of",
    "section",
    "to_config_error",
]

TRUE_STRINGS = frozenset({"true", "yes", "on", "1"})
FALSE_STRINGS = frozenset({"false", "no", "off", "0"})
INT64 = 2**63
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 4, 60, 60, 40
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 8


def describe(value: Any, *, secret: bool = False) -> str:
    """A rejected value for an error message: type and a short repr; secrets show no value."""
    if value is None:
        return "null"
    kind = "str" if isinstance(value, str) else type(value).__name__
    if secret:
        return kind
    if contains_secret(value):
        return f"{kind} {REDACTED}"
    try:
        text = _SHORT.repr(value)
    except Exception:  # a hostile __repr__, an int beyond the conversion limit
        text = "<unprintable>"
    return f"{kind} {text if len(text) <= 60 else text[:57] + '...'}"


def _expected(what: str, value: Any) -> ValueError:
    return ValueError(f"must be {what}, got {describe(value)}")


def _int(value: Any) -> int:
    if isinstance(value, bool) or value is None:
        raise _expected("an integer", value)
    result: int | None = None
    if isinstance(value, int) or (
        isinstance(value, float) and math.isfinite(value) and value.is_integer()
    ):
        result = int(value)
    elif isinstance(value, str) and len(value.strip()) <= MAX_INT_DIGITS:
        try:
            result = int(value.strip(), 10)
        except ValueError:
            number = _number_or_nan(value)
            result = int(number) if math.isfinite(number) and number.is_integer() else None
    elif isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        raise ValueError(f"must be a 64-bit integer, got a {len(value.strip())}-digit one")
    if result is None:
        raise _expected("an integer", value)
    if not -INT64 <= result < INT64:
        raise ValueError("must be a 64-bit integer, got a larger one")
    return result


def _number_or_nan(text: str) -> float:
    try:
        return float(text.strip())
    except (ValueError, OverflowError):
        return math.nan


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _expected("a number", value)
    try:
        number = float(value) if not isinstance(value, str) else float(value.strip())
    except (ValueError, OverflowError):
        raise _expected("a number", value) from None
    if not math.isfinite(number):
        raise _expected("a finite number", value)
    return number


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = value.strip().lower() if isinstance(value, str) else None
    if text in TRUE_STRINGS or text in FALSE_STRINGS:
        return text in TRUE_STRINGS
    raise _expected("a boolean (true/false/yes/no/on/off/1/0)", value)


def _str(value: Any) -> str:
    if isinstance(value, str):
        if looks_like_token(value):
            raise ValueError(
                "holds what looks like a Hub access token (not shown); the token goes in "
                "HF_TOKEN or the hf_token secret file"
            )
        return str(value)  # a plain str, also for SecretText
    if isinstance(value, int) and not isinstance(value, bool):
        if abs(value) >= 10**MAX_INT_DIGITS:
            raise ValueError(f"must be a string, got a {value.bit_length()}-bit integer")
        return str(value)
    if isinstance(value, float):
        return str(value)
    raise _expected("a string", value)


def _path(value: Any) -> str:
    text = _str(value)
    try:
        return check_path_text(text, "")
    except ConfigError as error:
        raise ValueError(str(error).strip()) from None


def _str_list(value: Any) -> list[str]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise _expected("a list of strings", value)
    for item in value:
        if not isinstance(item, str) or not item.strip():
            raise ValueError(f"must be a list of non-blank strings, got item {describe(item)}")
    return [str(item) for item in value]


def choice(value: Any) -> Any:
    """A choice (``Literal``) is matched without case or surrounding blanks. A value from a
    secret stays marked as one, so the error for a wrong choice does not echo it."""
    if not isinstance(value, str):
        return value
    folded = value.strip().lower()
    return SecretText(folded) if isinstance(value, SecretText) else folded


Int = Annotated[int, BeforeValidator(_int)]
Float = Annotated[float, BeforeValidator(_float)]
Bool = Annotated[bool, BeforeValidator(_bool)]
Str = Annotated[str, BeforeValidator(_str)]
PathStr = Annotated[str, BeforeValidator(_path)]
StrList = Annotated[list[str], BeforeValidator(_str_list)]


@dataclass(frozen=True)
class Says:
    """A field's 2.0.0 error wording (templates may use ``{field} {value} {low} {high}
    {interval}``): ``bound`` for a lower-bound violation, ``upper`` for an upper one, ``kind``
    for a wrong type or choice. Anything not given gets the generic text."""

    bound: str | None = None
    upper: str | None = None
    kind: str | None = None


def one_of(*names: str, says: str) -> Any:
    """A choice among ``names`` (matched without case), with its 2.0.0 error text."""
    return Annotated[Literal[names], BeforeValidator(choice), Says(kind=says)]


STEPS = {"gt": 0, "le": MAX_STEPS}  # a step count or cadence
BETWEEN = "{field} must be between {low} and {high}"


def F(default: Any, help: str, says: Says | None = None, **bounds: Any) -> Any:
    """A field's declaration: default, one line of help, bounds (``gt/ge/lt/le``), and the
    2.0.0 wording of its errors where that differs from the generic one."""
    info = Field(default, description=help, **bounds)
    if says is not None:
        info.metadata.append(says)
    return info


# --------------------------------------------------------------------------- errors
def bounds(metadata: Sequence[Any]) -> tuple[Any, Any, bool, bool]:
    """(low, high, low_open, high_open) of a field's constraints."""
    low = high = None
    low_open = high_open = False
    for item in metadata:
        if isinstance(item, Gt):
            low, low_open = item.gt, True
        elif isinstance(item, Ge):
            low = item.ge
        elif isinstance(item, Lt):
            high, high_open = item.lt, True
        elif isinstance(item, Le):
            high = item.le
    return low, high, low_open, high_open


def number_text(value: Any) -> str:
    """A bound or value in a message or the docs: ``1e+12``, ``0.001``, ``65535``."""
    if isinstance(value, float):
        return f"{value:g}"
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else "a huge number"
    return text if len(text) <= 40 else text[:37] + "..."


def metadata_of(info: Any) -> list[Any]:
    """A field's metadata: its own, plus what ``Annotated`` members of its type carry
    (``Steps | None`` keeps the bounds of ``Steps`` inside the union)."""
    found = list(getattr(info, "metadata", ()) or ())
    stack = list(typing.get_args(getattr(info, "annotation", None)))
    while stack:
        arg = stack.pop()
        if typing.get_origin(arg) is Annotated:
            for item in arg.__metadata__:
                found.extend(getattr(item, "metadata", None) or [item])
            stack.append(arg.__origin__)
        elif typing.get_origin(arg) in (typing.Union, types.UnionType):
            stack.extend(typing.get_args(arg))
    return found


def _bound_message(dotted: str, kind: str, value: Any, info: Any) -> str:
    """The text of a bound violation, from the field's own constraints."""
    metadata = metadata_of(info)
    says = next((item for item in metadata if isinstance(item, Says)), None)
    low, high, low_open, high_open = bounds(metadata)
    lower = kind in ("greater_than", "greater_than_equal")
    shown = {"field": dotted, "value": number_text(value)}
    shown.update(low=number_text(low), high=number_text(high), interval="")
    if low is not None and high is not None:
        shown["interval"] = (
            f"{'(' if low_open else '['}{shown['low']}, {shown['high']}{')' if high_open else ']'}"
        )
    template = says and (says.bound if lower else says.upper)
    if template:
        return template.format(**shown)
    if not lower:
        word = "less than" if high_open else "at most"
        return f"{dotted} must be {word} {shown['high']}, got {shown['value']}"
    if low == 0:
        return f"{dotted} must be positive" if low_open else f"{dotted} cannot be negative"
    word = "greater than" if low_open else "at least"
    return f"{dotted} must be {word} {shown['low']}"


def _locate(cls: type, loc: Sequence[Any]) -> tuple[str, Any, bool]:
    """(dotted name, FieldInfo, checked late) of an error location below ``cls`` (section
    names walk in). A field its section lists in ``__check_first__`` (the 2.0.0 check order)
    is not checked late."""
    names: list[str] = []
    info = None
    owner: Any = cls
    current: Any = cls
    for part in loc:
        fields = getattr(current, "__pydantic_fields__", None)
        if not isinstance(part, str) or not fields or part not in fields:
            break
        names.append(part)
        owner, info = current, fields[part]
        current = info.annotation
    late = not names or names[-1] not in getattr(owner, "__check_first__", ())
    return ".".join(names), info, late


def to_config_error(error: ValidationError, cls: type, prefix: str = "") -> ConfigError:
    """One line for the first problem of a pydantic ``ValidationError`` raised for ``cls``."""
    problems = error.errors(include_url=False)
    extra = [p for p in problems if p["type"] in ("unexpected_keyword_argument", "extra_forbidden")]
    if extra:
        return ConfigError(
            f"{prefix.rstrip('.')}: unknown configuration keys: {extra[0]['loc'][-1]}"
        )
    # the 2.0.0 check order first; in a union (``auto`` or a number) the number's own problem
    problem = min(problems, key=lambda p: (_locate(cls, p["loc"])[2], p["type"] == "literal_error"))
    dotted, info, _ = _locate(cls, problem["loc"])
    dotted = prefix + dotted if dotted else prefix.rstrip(".")
    cause = (problem.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):
        return cause
    says = next((m for m in metadata_of(info) if isinstance(m, Says)), None)
    kind = problem["type"]
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return ConfigError(_bound_message(dotted, kind, problem["input"], info))
    detail = str(cause) if cause is not None else None
    if says and says.kind:
        text = says.kind.format(field=dotted)
        if detail and kind == "value_error":
            return ConfigError(f"{text}: {dotted} {detail}")
        return ConfigError(f"{text}, got {describe(problem['input'])}")
    if detail is None and kind == "literal_error":
        expected = problem["ctx"]["expected"]
        detail = f"must be one of {expected}, got {describe(problem['input'])}"
    if detail is None:
        detail = f"is invalid ({problem['msg']}), got {describe(problem['input'])}"
    return ConfigError(f"{dotted} {detail}")


T = TypeVar("T")
_CONFIG = ConfigDict(arbitrary_types_allowed=True)


def section(name: str) -> Callable[[type[T]], type[T]]:
    """Make a config section: a pydantic dataclass whose errors are one-line ConfigErrors.

    ``name`` prefixes the field names in messages (``run`` -> ``run.max_steps``; ``""`` for the
    root). Construction is validated against the field declarations, then the class's
    ``__post_init__`` checks the rules that relate fields. As in 2.0.0, a later assignment is
    not validated (code and tests mutate a config step by step; ``validate()`` checks the
    whole again), so a section is an ordinary mutable dataclass once built.
    """

    def wrap(cls: type[T]) -> type[T]:
        built: Any = pydantic_dataclass(cls, config=_CONFIG)
        prefix = f"{name}." if name else ""
        init = built.__init__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                init(self, *args, **kwargs)
            except ValidationError as error:
                raise to_config_error(error, built, prefix) from None

        built.__init__ = __init__
        for item in built.__dataclass_fields__.values():  # dataclasses.fields() shows defaults
            info = item.default
            if isinstance(info, FieldInfo):
                if isinstance(info.default, (list, dict, set)):
                    item.default = dataclasses.MISSING
                    item.default_factory = functools.partial(copy.deepcopy, info.default)
                else:
                    item.default = info.default
        built.__config_section__ = name
        return built

    return wrap
