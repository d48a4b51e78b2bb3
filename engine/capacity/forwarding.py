"""Who sent a request when proxies stand in between: the client address fairness counts by.

`Forwarding.client(peer, forwarded_for)` takes the connection's address (`peer`) and the
request's `X-Forwarded-For` values and answers the address the request is from:

- a peer in FORWARDED_ALLOW_IPS (addresses or networks; `*` any) is a trusted proxy: the client
  is the right-most address of X-Forwarded-For that is not itself a trusted proxy (uvicorn's
  rule; with `*`, the left-most, as uvicorn's);
- otherwise, with FORWARDED_TRUSTED_HOPS = n > 0, the n-th address from the right: the one the
  last of n proxies in front of the app appended. A caller can write whatever it likes in the
  header it sends, but the proxies append to it, so what they wrote is at the end. On a Space
  (SPACE_ID set) the default is 1: the platform's front appends the visitor's address, and the
  app cannot be reached without passing through it;
- otherwise the peer itself: a direct caller cannot choose its identity.

When one untrusted peer forwards several different clients (UNTRUSTED_PROXY_CLIENTS), it is
likely a proxy the settings do not name, and every visitor behind it shares one client's miss
budget: that is logged once per peer and listed for the console (`untrusted_proxies`).
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from dataclasses import dataclass

from cachetools import LRUCache

log = logging.getLogger(__name__)

# Distinct forwarded clients from one untrusted peer before it is reported as a proxy.
UNTRUSTED_PROXY_CLIENTS = 3
# Untrusted peers watched at once (the least recent go first), and reported ones kept.
WATCHED_PEERS = 1_000
REPORTED_PEERS = 20
# A header longer than this is not an address list worth parsing (an attack or garbage).
MAX_FORWARDED_CHARS = 2_048

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class UntrustedProxy:
    peer: str  # a private address in full (infrastructure); a public one as a prefix label
    clients: int  # different forwarded clients seen (at least UNTRUSTED_PROXY_CLIENTS)


class Forwarding:
    """The client address of each request (see the module's docstring). Thread-safe."""

    def __init__(self, allow_ips: str, trusted_hops: int = 0) -> None:
        if trusted_hops < 0:
            raise ValueError("FORWARDED_TRUSTED_HOPS must be 0 or more")
        self.allow_ips = allow_ips
        self.trusted_hops = trusted_hops
        self._any = allow_ips.strip() == "*"
        self._networks: list[Network] = []
        self._literals: set[str] = set()
        for item in (part.strip() for part in allow_ips.split(",")):
            if not item or item == "*":
                continue
            try:
                self._networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                self._literals.add(item)  # a unix socket's name, as uvicorn allows
        self._lock = threading.Lock()
        self._watched: LRUCache[str, set[str]] = LRUCache(maxsize=WATCHED_PEERS)
        self._reported: dict[str, UntrustedProxy] = {}

    def trusts(self, host: str) -> bool:
        if self._any:
            return True
        address = _address(host)
        if address is None:
            return host in self._literals
        return any(address in network for network in self._networks)

    def client(self, peer: str | None, forwarded_for: list[str]) -> str | None:
        """The address the request is from: `peer` or one of X-Forwarded-For's."""
        if not forwarded_for or peer is None:
            return peer
        joined = ", ".join(forwarded_for)
        if len(joined) > MAX_FORWARDED_CHARS:
            return peer
        hosts = [_host(part) for part in joined.split(",")]
        if self.trusts(peer):
            if self._any:
                return hosts[0] or peer
            for host in reversed(hosts):
                if host and not self.trusts(host):
                    return host
            return hosts[0] or peer  # every hop trusted: the first is the client
        if self.trusted_hops and len(hosts) >= self.trusted_hops:
            host = hosts[-self.trusted_hops]
            if _address(host) is not None:
                return host
            return peer
        self._watch(peer, hosts[-1])
        return peer

    def _watch(self, peer: str, forwarded: str) -> None:
        if not forwarded:
            return
        with self._lock:
            if peer in self._reported:
                return
            seen = self._watched.get(peer)
            if seen is None:
                seen = self._watched[peer] = set()
            seen.add(forwarded)
            if len(seen) < UNTRUSTED_PROXY_CLIENTS:
                return
            del self._watched[peer]
            if len(self._reported) >= REPORTED_PEERS:
                return
            shown = _shown(peer)
            self._reported[peer] = UntrustedProxy(shown, len(seen))
        log.warning(
            "requests from %s forward %d or more different clients in X-Forwarded-For, but the "
            "settings do not trust it as a proxy: every client behind it counts as one, sharing one "
            "miss budget. If it is your proxy or load balancer, set FORWARDED_ALLOW_IPS to its "
            "address or network (or FORWARDED_TRUSTED_HOPS=1 when it appends the client's address).",
            shown, UNTRUSTED_PROXY_CLIENTS,
        )  # fmt: skip

    def untrusted_proxies(self) -> list[UntrustedProxy]:
        """Peers that forwarded several clients without being trusted (for the console)."""
        with self._lock:
            return list(self._reported.values())


def _host(part: str) -> str:
    """An X-Forwarded-For entry's address without its port or brackets ("" if empty)."""
    value = part.strip()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    if value.count(":") == 1:  # IPv4 with a port
        return value.split(":", 1)[0]
    return value


def _address(host: str) -> Address | None:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None


def _shown(peer: str) -> str:
    """A private address in full (the operator's own infrastructure, needed to trust it); a
    public one by its prefix only (it may be a person)."""
    address = _address(peer)
    if address is None:
        return "a non-IP peer"
    if not address.is_global:  # private, loopback, link-local, shared (CGNAT)...
        return str(address)
    if address.version == 4:
        return ".".join(str(address).split(".")[:3]) + ".x"
    return str(ipaddress.IPv6Network((address, 48), strict=False))
