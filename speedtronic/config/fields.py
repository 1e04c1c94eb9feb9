"""How a config field is declared once: ``name: Int = F(default, "help", gt=0, le=...)``.

The type aliases (:data:`Int`, :data:`Float`, :data:`Bool`, :data:`Str`, :data:`PathStr`,
:data:`StrList`) are pydantic ``BeforeValidator`` s for the input rules of SPEC §3 that pydantic's
lax mode does not have: no ``bool`` as a number, integral floats and numeric strings such as
``"1e3"``/``"3e-4"`` as numbers (PyYAML reads exponent floats as strings), 64-bit integers, the
boolean words true/false/yes/no/on/off/1/0 in any case and nothing else, numbers as strings,
no token-shaped text outside ``distributed.token``. A choice is a ``Literal`` (annotate
``Annotated[Literal[...], CHOICE]`` to match it without case). :func:`section` makes a class a
pydantic dataclass whose errors are one :class:`ConfigError` line naming the field, what was
expected and the value (never a secret); the layering adds where the value came from.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import reprlib
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, TypeVar, cast

from pydantic import BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic.dataclasses import is_pydantic_dataclass
from pydantic.fields import FieldInfo
from typing_extensions import dataclass_transform  # typing has it from Python 3.11

from speedtronic.config.limits import (
    MAX_INT_DIGITS,
    MAX_PATH,
    MAX_SEGMENT,
    MAX_STEPS,
    ConfigError,
)
from speedtronic.config.redaction import REDACTED, SecretText, contains_secret, looks_like_token

__all__ = [
    "CHOICE",
    "STEPS",
    "Bool",
    "F",
    "Float",
    "Int",
    "PathStr",
    "Str",
    "StrList",
    "choice",
    "describe",
    "fields_of",
    "section",
    "to_config_error",
]

TRUE_STRINGS = frozenset({"true", "yes", "on", "1"})
FALSE_STRINGS = frozenset({"false", "no", "off", "0"})
INT64 = 2**63
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 4, 60, 60, 40
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 8


def describe(value: object, *, secret: bool = False) -> str:
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


def _expected(what: str, value: object) -> ValueError:
    return ValueError(f"must be {what}, got {describe(value)}")


def _int(value: object) -> int:
    if isinstance(value, str) and len(value.strip()) > MAX_INT_DIGITS:
        if value.strip().lstrip("+-").isdigit():
            raise ValueError(f"must be a 64-bit integer, got a {len(value.strip())}-digit one")
        raise _expected("an integer", value)
    number: object = value
    if isinstance(value, str):
        try:
            number = int(value.strip(), 10)
        except ValueError:
            try:
                number = _float(value)
            except ValueError:
                number = None
    if isinstance(number, float) and number.is_integer():
        number = int(number)
    if isinstance(number, bool) or not isinstance(number, int):
        raise _expected("an integer", value)
    if not -INT64 <= number < INT64:
        raise ValueError("must be a 64-bit integer, got a larger one")
    return number


def _float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _expected("a number", value)
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (ValueError, OverflowError):
        raise _expected("a number", value) from None
    if not math.isfinite(number):
        raise _expected("a finite number", value)
    return number


def _bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = value.strip().lower() if isinstance(value, str) else None
    if text in TRUE_STRINGS or text in FALSE_STRINGS:
        return text in TRUE_STRINGS
    raise _expected("a boolean (true/false/yes/no/on/off/1/0)", value)


def _str(value: object) -> str:
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


def _path(value: object) -> str:
    """A path the OS can take: no NUL byte, at most ``MAX_PATH`` bytes, ``MAX_SEGMENT`` a part."""
    text = _str(value)
    encoded = text.encode("utf-8", "surrogateescape")
    if "\x00" in text:
        raise ValueError("must not contain a NUL byte")
    if len(encoded) > MAX_PATH:
        raise ValueError(f"is longer than {MAX_PATH} bytes")
    if max(len(part) for part in encoded.split(b"/")) > MAX_SEGMENT:
        raise ValueError(f"has a path segment longer than {MAX_SEGMENT} bytes")
    return text


def _str_list(value: object) -> list[str]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise _expected("a list of strings", value)
    for item in value:
        if not isinstance(item, str) or not item.strip():
            raise ValueError(f"must be a list of non-blank strings, got item {describe(item)}")
    return [str(item) for item in value]


def choice(value: object) -> object:
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


CHOICE = BeforeValidator(choice)
STEPS = {"gt": 0, "le": MAX_STEPS}  # a step count or cadence
T = TypeVar("T")


def F(
    default: T,
    help: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> T:
    """A field's declaration: default, one line of help, bounds (``gt/ge/lt/le``).

    Typed as its default so a checker compares the default with the annotation; what it
    returns is pydantic's ``FieldInfo`` (typed so by pydantic too), which :func:`section` reads.
    """
    return Field(default, description=help, gt=gt, ge=ge, lt=lt, le=le)


def fields_of(cls: type) -> dict[str, FieldInfo]:
    """The pydantic fields of a section class (or the aggregate), in declaration order."""
    if not is_pydantic_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a config section")
    return dict(cls.__pydantic_fields__)


def to_config_error(error: ValidationError, prefix: str = "") -> ConfigError:
    """One line for the first problem of a pydantic ``ValidationError``: ``prefix`` + the field
    path, what was expected (pydantic's own words: type, bound or allowed values), the value."""
    problems = error.errors(include_url=False)
    extra = [p for p in problems if p["type"] in ("unexpected_keyword_argument", "extra_forbidden")]
    if extra:
        return ConfigError(
            f"{prefix.rstrip('.')}: unknown configuration keys: {extra[0]['loc'][-1]}"
        )
    # in a union (``auto`` or a number) the number's own problem says more than the literal's
    problem = min(problems, key=lambda p: p["type"] == "literal_error")
    cause = (problem.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):
        return cause
    # a section's fields are flat: the field name, then list or tuple positions (a union's
    # member names, such as ``constrained-int``, are not part of the path)
    loc = problem["loc"]
    path = (prefix + str(loc[0]) if loc else prefix.rstrip(".")) + "".join(
        f"[{part}]" for part in loc[1:] if isinstance(part, int)
    )
    message = problem["msg"]
    if cause is not None:
        text = f"{path} {cause}"
    elif problem["type"] == "missing":  # a short tuple's missing item
        text = f"{path} is missing, got {describe(problem['input'])}"
    elif message.startswith("Input should be"):
        text = (
            f"{path} must be{message[len('Input should be') :]}, got {describe(problem['input'])}"
        )
    else:
        text = f"{path} is invalid ({message}), got {describe(problem['input'])}"
    # a union's literal member (``auto``) is the other value the field accepts
    others = [p for p in problems if p is not problem and p["type"] == "literal_error"]
    if others and others[0]["loc"][:1] == loc[:1]:
        alternative = f" (or {others[0]['ctx']['expected']})"
        head, got, tail = text.partition(", got ")
        text = f"{head}{alternative}{got}{tail}"
    return ConfigError(text)


_CONFIG = ConfigDict(arbitrary_types_allowed=True)


@dataclass_transform(field_specifiers=(dataclasses.field, Field))
def section(name: str) -> Callable[[type[T]], type[T]]:
    """Make a config section: a pydantic dataclass whose errors are one-line ConfigErrors.

    ``name`` prefixes the field names in messages (``run`` -> ``run.max_steps``; ``""`` for the
    root). Construction is validated against the field declarations, then the class's
    ``__post_init__`` checks the rules that relate fields. As in 2.0.0, a later assignment is
    not validated (code and tests mutate a config step by step; ``validate()`` checks the
    whole again), so a section is an ordinary mutable dataclass once built.
    """

    def wrap(cls: type[T]) -> type[T]:
        built = pydantic_dataclass(cls, config=_CONFIG)
        prefix = f"{name}." if name else ""
        init = built.__init__

        def __init__(self: object, *args: object, **kwargs: object) -> None:
            try:
                init(self, *args, **kwargs)
            except ValidationError as error:
                raise to_config_error(error, prefix) from None

        setattr(built, "__init__", __init__)  # noqa: B010  # mypy refuses assigning a method
        for item in built.__dataclass_fields__.values():  # dataclasses.fields() shows defaults
            info = item.default
            if isinstance(info, FieldInfo):
                if isinstance(info.default, (list, dict, set)):
                    item.default = dataclasses.MISSING
                    item.default_factory = functools.partial(copy.deepcopy, info.default)
                else:
                    item.default = info.default
        return cast("type[T]", built)

    return wrap
