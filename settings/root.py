"""`Settings`: every group, read from the environment once at start-up and passed down."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from settings.base import Group, reading
from settings.errors import SettingsError
from settings.groups import (
    Cache,
    Console,
    Fairness,
    Fleet,
    Limits,
    Log,
    Models,
    Quality,
    Redis,
    Server,
    Warmup,
)
from settings.remote import Remote


class Settings(BaseModel):
    """The app's settings by concern: `settings.redis.url`, `settings.cache.l1_max_bytes`, ...

    Frozen. `Settings.from_env()` reads them; `settings.changed(redis__url="off", ...)` is a
    copy with some changed (`group__field=value`, validated like the environment's values).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    server: Server
    models: Models
    cache: Cache
    redis: Redis
    log: Log
    limits: Limits
    fairness: Fairness
    fleet: Fleet
    quality: Quality
    warmup: Warmup
    console: Console
    remote: Remote

    @classmethod
    def groups(cls) -> dict[str, type[Group]]:
        """Each group's attribute name and class, in the reference's order."""
        return {name: field.annotation for name, field in cls.model_fields.items()}  # type: ignore[misc]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """The settings from `env` (None: os.environ); SettingsError names every refused value."""
        built: dict[str, Group] = {}
        refused: list[str] = []
        with reading(env):
            for name, group in cls.groups().items():
                try:
                    built[name] = group.read()
                except SettingsError as exc:
                    refused.append(str(exc))
        if refused:
            raise SettingsError("; ".join(refused))
        return cls(**built)

    def changed(self, **changes: Any) -> Settings:
        """A copy with settings changed, each named `group__field`: `changed(redis__url="off",
        server__data_dir=path)`."""
        by_group: dict[str, dict[str, Any]] = {}
        for key, value in changes.items():
            group, sep, field = key.partition("__")
            if not sep or group not in type(self).model_fields:
                raise TypeError(f"Settings.changed: {key!r} is not group__field (e.g. redis__url)")
            by_group.setdefault(group, {})[field] = value
        return self.model_copy(update={g: getattr(self, g).with_values(c) for g, c in by_group.items()})

    # --- derived values that span groups -------------------------------------------------------

    @property
    def export_dir(self) -> Path:
        return self.models.onnx_export_dir or self.server.data_dir / "onnx"

    @property
    def sqlite_path(self) -> Path:
        return self.server.data_dir / "requests.sqlite3"

    @property
    def effective_database_url(self) -> str:
        return self.log.database_url or f"sqlite:///{self.sqlite_path}"
