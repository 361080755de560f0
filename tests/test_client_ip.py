"""Issue 20 item 2: the client's address behind reverse proxies, its end user and endpoint.

Forwarding headers are believed only from a trusted peer, and read from the right: the
expected addresses are the ones standard practice (and RFC 7239's examples) give.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from activity.models import RequestLog
from gpuproxy.proxy.client_ip import client_ip, forwarded_for, parse_trusted, resolve
from tests.conftest import FAKE, free_port

TRUSTED = parse_trusted("10.0.0.0/8, 192.0.2.1, ::1")


def scope(peer: str | None, *headers: tuple[bytes, bytes]) -> dict:
    return {"client": (peer, 1234) if peer is not None else None, "headers": list(headers)}


# ---------------------------------------------------------------- the setting

def test_parse_trusted() -> None:
    assert [str(n) for n in parse_trusted(" 10.1.2.3 , 172.16.0.0/12,,fd00::/8 ")] == [
        "10.1.2.3/32", "172.16.0.0/12", "fd00::/8"]
    assert parse_trusted("") == ()


@pytest.mark.parametrize("value", ["10.0.0.0/33", "proxy.example.com", "10.0.0.1;10.0.0.2"])
def test_a_bad_entry_is_named(value: str) -> None:
    with pytest.raises(ValueError, match="is not an IP address or a CIDR network"):
        parse_trusted(value)


def test_a_bad_value_stops_the_start_naming_the_variable() -> None:
    env = {**os.environ, "GPUPROXY_TRUSTED_PROXIES": "10.0.0.1, nope"}
    out = subprocess.run([sys.executable, "manage.py", "check"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0
    assert "GPUPROXY_TRUSTED_PROXIES='10.0.0.1, nope': 'nope' is not an IP address" in out.stderr


# ---------------------------------------------------------------- X-Forwarded-For

@pytest.mark.parametrize(("peer", "xff", "expected"), [
    # the proxy's own peer, the client
    ("10.0.0.5", "203.0.113.9", "203.0.113.9"),
    # a chain: the client wrote the left one itself; 10.1.1.1 is a trusted proxy in between
    ("10.0.0.5", "6.6.6.6, 203.0.113.9, 10.1.1.1", "203.0.113.9"),
    # every hop trusted: the leftmost is the client
    ("10.0.0.5", "10.9.9.9, 10.1.1.1", "10.9.9.9"),
    # ports and brackets, as some proxies write them
    ("10.0.0.5", "203.0.113.9:5555", "203.0.113.9"),
    ("10.0.0.5", "[2001:db8::7]:443", "2001:db8::7"),
    ("::1", "2001:db8::7", "2001:db8::7"),
    # an IPv4-mapped peer is its IPv4 address
    ("::ffff:10.0.0.5", "203.0.113.9", "203.0.113.9"),
    # garbage stops the walk at the last trusted hop reached
    ("10.0.0.5", "not-an-ip", "10.0.0.5"),
    ("10.0.0.5", "203.0.113.9, unknown, 10.1.1.1", "10.1.1.1"),
    ("10.0.0.5", "", "10.0.0.5"),
    ("10.0.0.5", "999.1.1.1", "10.0.0.5"),
    # an untrusted peer's header is ignored whatever it says
    ("198.51.100.4", "203.0.113.9", "198.51.100.4"),
    ("198.51.100.4", "10.0.0.1", "198.51.100.4"),
])
def test_x_forwarded_for(peer: str, xff: str, expected: str) -> None:
    assert resolve(peer, xff.split(","), TRUSTED) == expected


def test_repeated_header_lines_are_one_list(settings) -> None:
    settings.GPUPROXY_TRUSTED_PROXIES = TRUSTED
    got = client_ip(scope("10.0.0.5", (b"x-forwarded-for", b"6.6.6.6, 203.0.113.9"),
                          (b"x-forwarded-for", b"10.1.1.1")))
    assert got == "203.0.113.9"


def test_without_trusted_proxies_the_peer_is_the_client(settings) -> None:
    settings.GPUPROXY_TRUSTED_PROXIES = ()
    assert client_ip(scope("10.0.0.5", (b"x-forwarded-for", b"203.0.113.9"))) == "10.0.0.5"
    assert client_ip(scope(None, (b"x-forwarded-for", b"203.0.113.9"))) == ""


# ---------------------------------------------------------------- Forwarded (RFC 7239)

def test_forwarded_for_nodes() -> None:
    # RFC 7239 section 4's examples, and a quoted comma that is not a separator
    assert forwarded_for(['for="_gazonk"', 'For="[2001:db8:cafe::17]:4711"',
                          "for=192.0.2.60;proto=http;by=203.0.113.43",
                          "for=192.0.2.43, for=198.51.100.17",
                          'by=10.0.0.1;host="a,b";for=198.51.100.18', "proto=https"]) == [
        '"_gazonk"', '"[2001:db8:cafe::17]:4711"', "192.0.2.60", "192.0.2.43",
        "198.51.100.17", "198.51.100.18", ""]


@pytest.mark.parametrize(("peer", "forwarded", "expected"), [
    ("10.0.0.5", 'for="[2001:db8:cafe::17]:4711"', "2001:db8:cafe::17"),
    ("10.0.0.5", "for=192.0.2.60;proto=http;by=203.0.113.43", "192.0.2.60"),
    ("10.0.0.5", "for=192.0.2.43, for=10.2.2.2", "192.0.2.43"),
    ("10.0.0.5", 'for="192.0.2.43:8080"', "192.0.2.43"),
    ("10.0.0.5", "for=198.51.100.17, for=192.0.2.1", "198.51.100.17"),  # 192.0.2.1 trusted
    ("10.0.0.5", 'for="_gazonk"', "10.0.0.5"),  # obfuscated: nothing known past the proxy
    ("10.0.0.5", "for=unknown", "10.0.0.5"),
    ("10.0.0.5", "proto=https", "10.0.0.5"),  # no for=
    ("10.0.0.5", 'for="[2001:db8::1', "10.0.0.5"),  # unterminated
    ("198.51.100.4", "for=192.0.2.60", "198.51.100.4"),  # untrusted peer
])
def test_forwarded(settings, peer: str, forwarded: str, expected: str) -> None:
    settings.GPUPROXY_TRUSTED_PROXIES = TRUSTED
    assert client_ip(scope(peer, (b"forwarded", forwarded.encode()))) == expected


def test_forwarded_wins_over_x_forwarded_for(settings) -> None:
    settings.GPUPROXY_TRUSTED_PROXIES = TRUSTED
    got = client_ip(scope("10.0.0.5", (b"X-Forwarded-For", b"6.6.6.6"),
                          (b"Forwarded", b"for=192.0.2.60")))
    assert got == "192.0.2.60"


# ---------------------------------------------------------------- a real serve request

def config(start: int) -> str:
    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      solo:
        cmd: {FAKE}
    """


def stop(proxy) -> None:
    proxy.proc.send_signal(signal.SIGTERM)
    assert proxy.proc.wait(30) == 0, proxy.output()


@pytest.mark.django_db(transaction=True)
def test_rows_behind_a_trusted_proxy(serve) -> None:
    proxy = serve(config(free_port()), extra_env={"GPUPROXY_TRUSTED_PROXIES": "127.0.0.1",
                                                  "GPUPROXY_MAX_BODY_MB": "1"})
    h = proxy.http
    chat = {"model": "solo", "messages": [{"role": "user", "content": "one two three"}],
            "max_tokens": 2}
    r = h.post("/v1/chat/completions", json={**chat, "user": "alice"},
               headers={"X-Forwarded-For": "6.6.6.6, 203.0.113.9"})
    assert r.status_code == 200, r.text
    r = h.post("/v1/completions", json={"model": "solo", "prompt": "a b", "max_tokens": 1},
               headers={"Forwarded": 'for="[2001:db8:cafe::17]:4711"'})
    assert r.status_code == 200, r.text
    assert h.post("/v1/embeddings", json={"model": "solo", "input": "a"}).status_code == 200
    # refused at the edge from its Content-Length, before the consumer: the same address
    r = h.post("/v1/rerank", content=b"x" * (1024 * 1024 + 1),
               headers={"X-Forwarded-For": "203.0.113.77", "Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    stop(proxy)
    rows = {r.endpoint: r for r in RequestLog.objects.all()}
    assert set(rows) == {"chat", "completions", "embeddings", "rerank"}
    assert (rows["rerank"].client_ip, rows["rerank"].outcome) == ("203.0.113.77", "bad_request")
    assert (rows["chat"].client_ip, rows["chat"].client, rows["chat"].end_user) == (
        "203.0.113.9", "203.0.113.9", "alice")
    assert rows["completions"].client_ip == "2001:db8:cafe::17"
    assert (rows["embeddings"].client_ip, rows["embeddings"].end_user) == ("127.0.0.1", "")
    # the token columns, from the fake upstream's usage (3 words, 2 tokens asked)
    assert (rows["chat"].input_tokens, rows["chat"].output_tokens) == (3, 2)
    assert not rows["chat"].output_tokens_counted


@pytest.mark.django_db(transaction=True)
def test_forwarding_headers_from_an_untrusted_peer_are_ignored(serve) -> None:
    proxy = serve(config(free_port()))  # no GPUPROXY_TRUSTED_PROXIES
    r = proxy.http.post("/v1/chat/completions", json={
        "model": "solo", "max_tokens": 1, "messages": [{"role": "user", "content": "a"}]},
        headers={"X-Forwarded-For": "203.0.113.9", "Forwarded": "for=192.0.2.60"})
    assert r.status_code == 200, r.text
    stop(proxy)
    (row,) = RequestLog.objects.all()
    assert (row.client_ip, row.client, row.endpoint) == ("127.0.0.1", "127.0.0.1", "chat")
