"""What every group of settings is made of: a frozen pydantic-settings class whose fields each
name their environment variable, read from one mapping (the process environment by default).

A field is declared with `var(NAME, default, shown=..., description=...)`: NAME is the
variable, `shown` the default as the settings reference prints it, `description` the meaning
it prints (settings.reference renders docs/CONFIGURATION.md from these). Blank values mean the
default; a value the app cannot run with raises `SettingsError` naming the variable, the value
given and what it accepts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Annotated, Any, ClassVar, Self, get_args

from pydantic import AliasChoices, BeforeValidator, Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError, PydanticUndefined
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from settings.errors import SettingsError

# The mapping `Settings.from_env` reads; None: the process environment.
_ENV: ContextVar[Mapping[str, str] | None] = ContextVar("settings_env", default=None)


@contextmanager
def reading(env: Mapping[str, str] | None) -> Iterator[None]:
    """Groups built inside read `env` (None: os.environ)."""
    token = _ENV.set(env)
    try:
        yield
    finally:
        _ENV.reset(token)


# --- parsing, as int() and float() do, with the variable's minimum in the refusal -------------


def _parsed(kind: type, what: str) -> BeforeValidator:
    def parse(value: Any) -> Any:
        if isinstance(value, str):
            try:
                return kind(value)
            except ValueError:
                raise PydanticCustomError("not_" + kind.__name__, what) from None
        return value

    return BeforeValidator(parse)


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


Int = Annotated[int, _parsed(int, "an integer")]
Float = Annotated[float, _parsed(float, "a number")]
Lower = BeforeValidator(_lower)  # choices are case-insensitive: Annotated[Literal[...], Lower]


# --- fields -------------------------------------------------------------------------------------


def var(
    name: str,
    default: Any = PydanticUndefined,
    *,
    shown: str,
    description: str,
    default_factory: Any = None,
    also: tuple[str, str, str] | None = None,
    **constraints: Any,
) -> Any:
    """A setting read from the variable `name`; `also` = (name, shown, description): a second
    variable for the same setting (set one of the two, never both)."""
    extra: dict[str, Any] = {"env": name, "shown": shown}
    alias: str | AliasChoices = name
    if also is not None:
        extra["also"] = list(also)
        alias = AliasChoices(name, also[0])
    if default_factory is not None:
        return Field(default_factory=default_factory, validation_alias=alias, description=description,
                     json_schema_extra=extra, **constraints)  # fmt: skip
    return Field(default, validation_alias=alias, description=description, json_schema_extra=extra,
                 **constraints)  # fmt: skip


def env_names(field: FieldInfo) -> list[str]:
    """The variables a field reads, its own first."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    names = [extra["env"]] if "env" in extra else []
    if "also" in extra:
        names.append(extra["also"][0])
    return [str(n) for n in names]


class _Environment(PydanticBaseSettingsSource):
    """Each field's variable(s) from the mapping being read, stripped; blank ones left out."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads every field itself

    def __call__(self) -> dict[str, Any]:
        env = _ENV.get()
        env = os.environ if env is None else env
        found: dict[str, Any] = {}
        for field in self.settings_cls.model_fields.values():
            names = env_names(field)
            given = {n: raw.strip() for n in names if (raw := env.get(n)) is not None and raw.strip()}
            if len(given) > 1:
                raise SettingsError(f"set {' or '.join(names)}, not both")
            found.update(given)
        return found


class Group(BaseSettings):
    """One concern's settings. Subclasses set `heading` (the reference's section title) and a
    docstring (the sentence under it)."""

    model_config = SettingsConfigDict(
        frozen=True, extra="forbid", case_sensitive=True, validate_by_name=True, validate_by_alias=True,
        protected_namespaces=(),
    )  # fmt: skip
    heading: ClassVar[str]

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, _Environment(settings_cls)

    @classmethod
    def read(cls) -> Self:
        """The group from the mapping being read (see `reading`); SettingsError when refused."""
        try:
            return cls()
        except ValidationError as exc:
            raise SettingsError(cls.explain(exc)) from None

    def with_values(self, changes: Mapping[str, Any]) -> Self:
        """A copy with these fields (by name) changed, validated as the environment's would be."""
        unknown = set(changes) - set(type(self).model_fields)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no setting {', '.join(sorted(unknown))}")
        try:
            return type(self).model_validate({**dict(self), **changes})
        except ValidationError as exc:
            raise SettingsError(type(self).explain(exc)) from None

    @classmethod
    def env_name(cls, key: str) -> str:
        """The variable behind a field (`key`: its name or one of its variables)."""
        field = cls.model_fields.get(key)
        return env_names(field)[0] if field is not None else key

    @classmethod
    def explain(cls, exc: ValidationError) -> str:
        """One line for every refused value: the variable, the value given, what it accepts."""
        return "; ".join(cls._explain_one(error) for error in exc.errors())

    @classmethod
    def _explain_one(cls, error: Any) -> str:
        ctx = error.get("ctx") or {}
        if isinstance(ctx.get("error"), SettingsError):
            return str(ctx["error"])
        key = str(error["loc"][0]) if error["loc"] else ""
        name, value = cls.env_name(key), error.get("input")
        field = cls.model_fields.get(key) or next(
            (f for f in cls.model_fields.values() if key in env_names(f)), None
        )
        bounds = _bounds(field)
        kind = error["type"]
        if kind in ("not_int", "not_float"):
            return f"{name}={value!r} is not {error['msg']}{f' ({bounds})' if bounds else ''}"
        if kind in ("greater_than_equal", "less_than_equal"):
            return f"{name}={value} must be {bounds}"
        if kind == "literal_error" and field is not None:
            choices = ", ".join(str(c) for c in get_args(field.annotation))
            return f"{name}={value!r} must be one of {choices or ctx.get('expected')}"
        if kind == "value_error" and "error" in ctx:
            return f"{name}={value!r}: {ctx['error']}"
        return f"{name}={value!r}: {error['msg']}"


def _bounds(field: FieldInfo | None) -> str:
    """What a number accepts, as the refusals word it: ">= 1", "between 0 and 1"."""
    if field is None:
        return ""
    low = next((m.ge for m in field.metadata if hasattr(m, "ge")), None)
    high = next((m.le for m in field.metadata if hasattr(m, "le")), None)
    if low is not None and high is not None:
        return f"between {low:g} and {high:g}"
    if low is not None:
        return f">= {low}"
    return f"<= {high}" if high is not None else ""
