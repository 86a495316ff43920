"""Where the judge's API key may go: an https endpoint (plain http only to this machine, when
allowed), the key read from the environment, and an opener that refuses every redirect so the
Authorization header is never forwarded to another URL. `judge_answers` takes any opener with
urllib's `open(request, timeout=...)`, so a stricter policy can be plugged in."""

from __future__ import annotations

import ipaddress
import os
import urllib.error
import urllib.parse
import urllib.request

LOCAL_HOSTS = frozenset({"localhost"})


def judge_url(endpoint_url: str, *, allow_http: bool = False) -> str:
    """The chat-completions URL of `endpoint_url` (a base URL such as "https://api.openai.com", a
    …/v1 URL or the full …/chat/completions URL). https only: plain http is refused unless
    `allow_http`, and even then only to localhost / a loopback address, so a key never crosses a
    network in clear text."""
    parsed = urllib.parse.urlsplit(endpoint_url.strip())
    host = parsed.hostname or ""
    if parsed.username or parsed.password:
        raise ValueError(f"judge endpoint {host}: credentials in the URL are refused; the key is read from the "
                         "environment (--judge-key-env)")
    if parsed.scheme == "http":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host.lower() in LOCAL_HOSTS
        if not allow_http:
            raise ValueError(f"judge endpoint {endpoint_url!r} is plain http; use https (or, for a judge on this "
                             "machine, allow http to localhost with --judge-allow-http)")
        if not loopback:
            raise ValueError(f"judge endpoint {endpoint_url!r}: plain http is allowed only to localhost / "
                             "127.0.0.1; use https for any other host")
    elif parsed.scheme != "https" or not host:
        raise ValueError(f"judge endpoint {endpoint_url!r} is not an https URL")
    url = urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, parsed.path.rstrip("/"), "", ""))
    if not url.endswith("/chat/completions"):
        url += "/chat/completions" if url.endswith("/v1") else "/v1/chat/completions"
    return url


def judge_api_key(api_key_env: str | None) -> str | None:
    """The API key from the environment variable `api_key_env` (None: no key, for a local server)."""
    if api_key_env is None:
        return None
    key = os.environ.get(api_key_env)
    if not key:
        raise ValueError(f"judge: the environment variable {api_key_env} holding the API key is not set "
                         "(pass api_key_env=None for an endpoint without authentication)")
    return key


class RedirectRefused(urllib.error.URLError):
    """A redirect from the judge endpoint; never retried."""


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """urllib would follow a redirect and send the Authorization header to wherever it points."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise RedirectRefused(f"the judge endpoint {req.full_url} answered HTTP {code}, a redirect to {newurl}; "
                              "redirects are refused so that the API key goes only to the configured URL "
                              "(give the final URL as the endpoint)")


def safe_opener() -> urllib.request.OpenerDirector:
    """urllib's opener without redirects (and with the environment's proxies, as urllib's default)."""
    return urllib.request.build_opener(_RefuseRedirects)
