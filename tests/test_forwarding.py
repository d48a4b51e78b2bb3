"""Who a request is from behind proxies (engine.capacity.forwarding): trusted proxies by address,
proxies trusted by position (FORWARDED_TRUSTED_HOPS, a Space's default), a direct caller who
cannot choose its identity, and one notice per untrusted proxy that forwards many clients."""

from __future__ import annotations

import logging

import pytest

from engine.capacity.forwarding import UNTRUSTED_PROXY_CLIENTS, Forwarding
from settings import Settings


def test_a_trusted_peer_names_the_right_most_untrusted_client() -> None:
    forwarding = Forwarding("127.0.0.1,10.0.0.0/8")
    assert forwarding.client("127.0.0.1", ["203.0.113.5"]) == "203.0.113.5"
    # Proxies append: the entries a caller wrote itself come first and are passed over.
    assert forwarding.client("127.0.0.1", ["192.0.2.9, 203.0.113.5, 10.1.2.3"]) == "203.0.113.5"
    assert forwarding.client("127.0.0.1", ["203.0.113.5", "10.1.2.3"]) == "203.0.113.5"  # two headers
    assert forwarding.client("127.0.0.1", ["[2001:db8::1]:443"]) == "2001:db8::1"
    assert forwarding.client("127.0.0.1", ["203.0.113.5:5000"]) == "203.0.113.5"
    assert forwarding.client("127.0.0.1", []) == "127.0.0.1"


def test_a_direct_caller_cannot_choose_its_identity() -> None:
    forwarding = Forwarding("127.0.0.1")
    assert forwarding.client("198.51.100.7", ["203.0.113.5"]) == "198.51.100.7"
    assert forwarding.client("198.51.100.7", ["x" * 5000]) == "198.51.100.7"


def test_trusted_hops_take_what_the_last_proxy_appended() -> None:
    forwarding = Forwarding("127.0.0.1", trusted_hops=1)
    # A Space's front at an internal address appends the visitor's address.
    assert forwarding.client("10.16.3.80", ["203.0.113.21"]) == "203.0.113.21"
    assert forwarding.client("10.16.3.80", ["192.0.2.50, 203.0.113.21"]) == "203.0.113.21"  # forged first
    assert forwarding.client("10.16.3.80", ["not-an-address"]) == "10.16.3.80"
    assert forwarding.client("10.16.3.80", []) == "10.16.3.80"
    two = Forwarding("127.0.0.1", trusted_hops=2)  # a CDN, then the platform's balancer
    assert two.client("10.0.0.2", ["192.0.2.50, 203.0.113.21, 198.51.100.1"]) == "203.0.113.21"
    assert two.client("10.0.0.2", ["203.0.113.21"]) == "10.0.0.2"  # fewer entries than proxies
    with pytest.raises(ValueError):
        Forwarding("127.0.0.1", trusted_hops=-1)


def test_a_space_trusts_its_front_by_default_and_other_hosts_do_not() -> None:
    assert Settings.from_env({"SPACE_ID": "someone/demo"}).fairness.forwarded_trusted_hops == 1
    assert Settings.from_env({}).fairness.forwarded_trusted_hops == 0
    opted_out = Settings.from_env({"SPACE_ID": "someone/demo", "FORWARDED_TRUSTED_HOPS": "0"})
    assert opted_out.fairness.forwarded_trusted_hops == 0


def test_an_untrusted_proxy_forwarding_many_clients_is_reported_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    forwarding = Forwarding("127.0.0.1")
    caplog.set_level(logging.WARNING, logger="engine.capacity.forwarding")
    for n in range(UNTRUSTED_PROXY_CLIENTS - 1):
        forwarding.client("10.16.3.80", [f"203.0.113.{n}"])
        forwarding.client("10.16.3.80", [f"203.0.113.{n}"])  # the same client again counts once
    assert forwarding.untrusted_proxies() == [] and not caplog.records
    for n in range(50):
        forwarding.client("10.16.3.80", [f"198.51.100.{n}"])
    for n in range(UNTRUSTED_PROXY_CLIENTS):  # a public peer (perhaps a person): shown by prefix
        forwarding.client("93.184.216.34", [f"192.0.2.{n + 10}"])
    proxies = forwarding.untrusted_proxies()
    assert [p.peer for p in proxies] == ["10.16.3.80", "93.184.216.x"]
    assert len(caplog.records) == 2  # once per proxy, not once per request
    assert "FORWARDED_ALLOW_IPS" in caplog.records[0].getMessage()
    assert "93.184.216.34" not in caplog.text
