"""Reference audio given as an http(s) URL (vllm-omni's speech API documents `ref_audio` as a URL or base64), fetched
under the server's rules — off unless the operator names the hosts:

* only `http` / `https`, only hosts on `--ref-audio-hosts` (exact names, or `*.example.com` for its subdomains);
* every address the name resolves to must be public (no loopback, private, link-local, multicast or reserved
  address: a request cannot reach the server's own network), unless `--ref-audio-private-ok`; the connection goes to
  the address that was checked (no second DNS lookup that could answer differently);
* no redirects (a 3xx is refused, so it cannot lead anywhere else), a timeout for the whole fetch, and at most
  `cap` bytes (Content-Length checked first, then while reading).

Runs in a worker thread (the server calls it from its decode pool)."""
from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
from urllib.parse import urlsplit

from .errors import APIError, invalid

SCHEMES = {"http": 80, "https": 443}


def host_allowed(host: str, allowed: list[str]) -> bool:
    host = host.lower().rstrip(".")
    for pattern in allowed:
        pattern = pattern.lower().rstrip(".")
        if pattern.startswith("*.") and host.endswith(pattern[1:]) and host != pattern[2:]:
            return True
        if host == pattern:
            return True
    return False


def public_address(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_global and not addr.is_multicast


def _getaddrinfo(host: str, port: int, timeout: float) -> list:
    """socket.getaddrinfo with a time limit (the resolver has none of its own): it runs in a daemon thread that is
    left behind if it does not answer in time."""
    box: dict = {}

    def look():
        try:
            box["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=look, name="ref-audio-dns", daemon=True)
    t.start()
    t.join(max(0.0, timeout))
    if t.is_alive():
        raise TimeoutError(f"DNS lookup of {host!r} took longer than {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box["infos"]


def _resolve(host: str, port: int, private_ok: bool, param: str, timeout: float = 10.0) -> str:
    try:
        infos = _getaddrinfo(host, port, timeout)
    except (socket.gaierror, UnicodeError) as e:
        raise invalid(f"'{param}' host {host!r} does not resolve: {e}", param, "ref_audio_unreachable") from None
    addresses = [info[4][0] for info in infos]
    if not addresses:
        raise invalid(f"'{param}' host {host!r} has no address", param, "ref_audio_unreachable")
    if not private_ok:
        blocked = [a for a in addresses if not public_address(a)]
        if blocked:
            raise invalid(f"'{param}' host {host!r} resolves to a non-public address ({blocked[0]}); the server "
                          f"fetches reference audio from public addresses only", param, "url_not_allowed")
    return addresses[0]


class _PinnedHTTP(http.client.HTTPConnection):
    """Connects to the address that was checked, while the Host header keeps the name."""

    def __init__(self, host, ip, port, timeout):
        super().__init__(host, port, timeout=timeout)
        self._ip = ip

    def connect(self):
        self.sock = socket.create_connection((self._ip, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    def __init__(self, host, ip, port, timeout):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._ip = ip

    def connect(self):
        sock = socket.create_connection((self._ip, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # certificate checked for the name


def fetch_ref_audio(url: str, *, allowed_hosts: list[str] | None, cap: int, timeout: float,
                    private_ok: bool = False, param: str = "ref_audio") -> bytes:
    """The bytes at `url` under the rules above; 400 (with a reason) / 413 / 408 otherwise."""
    if not allowed_hosts:
        raise invalid(f"'{param}' URLs are not fetched by this server (start it with --ref-audio-hosts to allow "
                      f"some hosts); send the audio inline (data: URI or base64)", param, "url_not_allowed")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise invalid(f"'{param}' is not a valid URL: {e}", param, "invalid_value") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise invalid(f"'{param}' URL scheme must be http or https", param, "url_not_allowed")
    host = parts.hostname or ""
    if parts.username is not None or parts.password is not None:
        raise invalid(f"'{param}' URL must not carry credentials", param, "url_not_allowed")
    if not host or not host_allowed(host, allowed_hosts):
        raise invalid(f"'{param}' host {host!r} is not on the server's --ref-audio-hosts list", param,
                      "url_not_allowed")
    port = port or SCHEMES[scheme]
    deadline = time.monotonic() + timeout
    try:
        ip = _resolve(host, port, private_ok, param, timeout)
    except TimeoutError:
        raise APIError(408, f"'{param}' URL did not deliver within {timeout:g} s (DNS lookup)", param=param,
                       code="ref_audio_timeout") from None
    conn_cls = _PinnedHTTPS if scheme == "https" else _PinnedHTTP
    conn = conn_cls(host, ip, port, max(0.01, deadline - time.monotonic()))
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        conn.request("GET", path, headers={"User-Agent": "cosytrt", "Accept": "audio/*"})
        resp = conn.getresponse()
        if 300 <= resp.status < 400:
            raise invalid(f"'{param}' URL answered a redirect ({resp.status}); redirects are not followed", param,
                          "url_redirect")
        if resp.status != 200:
            raise invalid(f"'{param}' URL answered HTTP {resp.status}", param, "ref_audio_unreachable")
        declared = resp.getheader("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise APIError(413, f"'{param}' is {declared} bytes; at most {cap} are accepted", param=param,
                           code="payload_too_large")
        parts_read, total = [], 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise APIError(408, f"'{param}' URL did not deliver within {timeout:g} s", param=param,
                               code="ref_audio_timeout")
            if conn.sock is not None:  # one slow read may not outlast the whole fetch's time limit
                conn.sock.settimeout(left)
            chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)
            if not chunk:
                break
            total += len(chunk)
            if total > cap:
                raise APIError(413, f"'{param}' exceeds {cap} bytes", param=param, code="payload_too_large")
            parts_read.append(chunk)
        return b"".join(parts_read)
    except (OSError, http.client.HTTPException) as e:  # timeouts, refused connections, TLS errors
        if isinstance(e, TimeoutError) or "timed out" in str(e):
            raise APIError(408, f"'{param}' URL did not deliver within {timeout:g} s", param=param,
                           code="ref_audio_timeout") from None
        raise invalid(f"'{param}' URL could not be fetched: {type(e).__name__}: {e}", param,
                      "ref_audio_unreachable") from None
    finally:
        conn.close()
