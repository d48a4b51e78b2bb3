"""REDIS_URL: its accepted forms, its parser and a redactor for messages and logs."""

from __future__ import annotations

from dataclasses import dataclass, field

from settings.errors import SettingsError

# REDIS_URL's accepted forms, shown whole in every refusal so the fix is in the message.
REDIS_URL_FORMS = (
    "redis://[[user]:password@]host[:port][/db] or rediss://... (TLS): one node; "
    "unix:///path/to/redis.sock[?db=N]; "
    "redis+cluster://[[user]:password@]host:port[,host:port...] or rediss+cluster://...: a Redis Cluster "
    "(any of its nodes); "
    "redis+sentinel://[[user]:password@]host:port[,host:port...]/service_name[/db] or rediss+sentinel://...: "
    "the primary that these Sentinels name; "
    "off: no L2"
)
_NODE_SCHEMES = ("redis://", "rediss://", "unix://")
_MULTI_SCHEMES = {
    "redis+cluster": ("cluster", False), "rediss+cluster": ("cluster", True),
    "redis+sentinel": ("sentinel", False), "rediss+sentinel": ("sentinel", True),
}  # fmt: skip
_DEFAULT_PORTS = {"cluster": 6379, "sentinel": 26379}


@dataclass(frozen=True)
class RedisTarget:
    """A parsed REDIS_URL. `kind` "node": `url` goes to redis-py as it is; "cluster" and
    "sentinel": the seed `nodes` (Sentinels for "sentinel"), the `service` name and `db`."""

    kind: str  # "node" | "cluster" | "sentinel"
    url: str = field(repr=False)
    nodes: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False


def redact_url(url: str) -> str:
    """The URL with any credentials replaced by ***, for messages and logs."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url


def _host_port(text: str, default_port: int) -> tuple[str, int]:
    if text.startswith("["):  # [v6]:port
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host or (port and not port.isdigit()) or not 0 < int(port or default_port) < 65536:
        raise ValueError(f"{text!r} is not host:port")
    return host, int(port or default_port)


def parse_redis_url(url: str) -> RedisTarget:
    """Parse REDIS_URL (any form of REDIS_URL_FORMS but "off"); SettingsError when malformed."""
    from urllib.parse import unquote

    def refuse(why: str) -> SettingsError:
        return SettingsError(f"REDIS_URL={redact_url(url)!r}: {why}. Accepted forms: {REDIS_URL_FORMS}")

    scheme, sep, rest = url.partition("://")
    if url.startswith(_NODE_SCHEMES):
        if scheme != "unix":
            netloc, _, path = rest.partition("/")
            try:
                _host_port(netloc.rpartition("@")[2] or "localhost", 6379)
            except ValueError as exc:
                raise refuse(str(exc)) from None
            if path.split("?")[0] and not path.split("?")[0].isdigit():
                raise refuse(f"the database {path!r} is not a number")
        elif not rest.strip("/"):
            raise refuse("a unix:// URL needs the socket's path")
        return RedisTarget(kind="node", url=url)
    if not sep or scheme.lower() not in _MULTI_SCHEMES:
        raise refuse(f"unknown scheme {scheme + sep if sep else url!r}")
    kind, tls = _MULTI_SCHEMES[scheme.lower()]
    credentials, _, hosts_and_path = rest.rpartition("@")
    username, password = None, None
    if credentials:
        user, colon, secret = credentials.partition(":")
        username, password = (unquote(user) or None, unquote(secret)) if colon else (None, unquote(user))
    hosts, _, path = hosts_and_path.partition("/")
    try:
        nodes = tuple(_host_port(h.strip(), _DEFAULT_PORTS[kind]) for h in hosts.split(","))
    except ValueError as exc:
        raise refuse(str(exc)) from None
    parts = [p for p in path.split("/") if p]
    if kind == "cluster":
        if parts and parts != ["0"]:
            raise refuse("a cluster has one database (0) and takes no path")
        return RedisTarget(kind, url, nodes, None, 0, username, password, tls)
    if not parts or len(parts) > 2:
        raise refuse("a sentinel URL ends in /service_name or /service_name/db")
    if len(parts) == 2 and not parts[1].isdigit():
        raise refuse(f"the database {parts[1]!r} is not a number")
    db = int(parts[1]) if len(parts) == 2 else 0
    return RedisTarget(kind, url, nodes, unquote(parts[0]), db, username, password, tls)
