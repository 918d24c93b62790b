"""``nginx_config``: a complete nginx.conf that makes a plain nginx a caching relay for a run.

Every object but ``<run>/HEAD`` (and ``<run>/WRITER``) is written once and named by its version,
so a cache may keep it forever; nginx then gives fan-out (one upstream copy per region), ranges
served from its cache and request coalescing (``proxy_cache_lock``). The rules, one ``location``
each:

* immutable objects: cached 365 days (200 only), served with ``Cache-Control: public,
  max-age=31536000, immutable``; the query (``?wait=``) is dropped, so it neither splits the cache
  nor reaches the upstream;
* ``<run>/HEAD`` and ``<run>/WRITER``: a 1 s micro-cache that ignores the upstream's
  ``Cache-Control: no-cache`` (``proxy_ignore_headers``), with ``proxy_cache_lock``: however many
  readers poll, the upstream sees about one request a second;
* listings (``GET /?prefix=P``): keyed by the full request URI (two prefixes never share an
  entry), cached 1 s only;
* ``/healthz`` and ``/metrics``: never cached (a health check must fail once the upstream dies);
* errors (404: "not uploaded yet") are never cached and never marked immutable.

What nginx does not do (use ``deltarl relay`` for these): hold a request until an object lands
(readers back off instead), cut an object through before it is whole, check piece hashes against
manifests, accept pushes.

The upstream is either a ``deltarl relay`` (or any server of its HTTP API) or, with
``bucket=True``, an S3/MinIO/SeaweedFS bucket endpoint ``http://host:port/bucket[/prefix]``:
paths are rewritten to ``/bucket/prefix/<key>`` (the bucket must allow anonymous reads or sit
behind a signing proxy); listings are then refused (S3 lists in XML) and ``/healthz`` probes the
bucket's root.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from deltarl.errors import ConfigError

IMMUTABLE = "public, max-age=31536000, immutable"


@dataclass(frozen=True)
class NginxRelayConfig:
    """What the generated nginx.conf depends on."""

    upstream: str
    listen: str = "0.0.0.0:8470"
    cache_dir: str = "/var/cache/deltarl"
    bucket: bool = False
    max_size: str = "200g"
    keys_zone_mb: int = 64


def _split_upstream(url: str, bucket: bool) -> tuple[str, str, str]:
    """``(scheme, host:port, path prefix)`` of the upstream URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"--upstream must be http(s)://host:port[/path], got {url!r}")
    if parts.query or parts.fragment:
        raise ConfigError(f"--upstream must not carry a query or fragment: {url!r}")
    netloc = parts.netloc if parts.port else f"{parts.hostname}:{443 if parts.scheme == 'https' else 80}"
    path = parts.path.strip("/")
    if bucket and not path:
        raise ConfigError(f"a bucket endpoint upstream needs the bucket in its path (http://host:port/bucket[/prefix]): {url!r}")
    if not bucket and path:
        raise ConfigError(f"a relay upstream is http(s)://host:port without a path (for a bucket, add --bucket-endpoint): {url!r}")
    if any(c in path for c in " ;{}$\"'\\"):
        raise ConfigError(f"upstream path has characters nginx would misread: {path!r}")
    return parts.scheme, netloc, path


def _check_listen(listen: str) -> None:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--listen must be HOST:PORT, got {listen!r}")


def nginx_config(cfg: NginxRelayConfig) -> str:
    """The nginx.conf text for ``cfg`` (see the module docstring for the rules)."""
    scheme, netloc, path = _split_upstream(cfg.upstream, cfg.bucket)
    _check_listen(cfg.listen)
    cache = cfg.cache_dir.rstrip("/") or "/"
    if any(c in cache for c in " ;{}$\"'\\"):
        raise ConfigError(f"--cache-dir has characters nginx would misread: {cache!r}")
    upstream = f"{scheme}://deltarl_upstream"
    prefix = f"/{path}/" if path else "/"
    # objects: drop the query (the trailing '?'), map the key under the bucket's prefix if any
    rewrite = f"rewrite ^/(.*)$ {prefix}$1? break;"
    host = f"proxy_set_header Host {netloc};" if cfg.bucket else "proxy_set_header Host $proxy_host;"
    tls = f"\n            proxy_ssl_server_name on;\n            proxy_ssl_name {netloc.rsplit(':', 1)[0]};" if scheme == "https" else ""
    common = f"""proxy_pass {upstream};{tls}
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            {host}
            proxy_hide_header Cache-Control;
            proxy_hide_header Expires;"""
    if cfg.bucket:
        health = f"""    location = /healthz {{              # the bucket endpoint answers at all (even 403/404): healthy
            rewrite ^ /{path.split('/')[0]}? break;
            {common}
            proxy_method HEAD;
            proxy_cache off;
            proxy_intercept_errors on;
            error_page 403 404 = @deltarl_reachable;
            add_header Cache-Control "no-store" always;
        }}

        location @deltarl_reachable {{
            add_header Cache-Control "no-store" always;
            return 200 "ok\\n";
        }}

        location = /metrics {{ return 404; }}  # a bucket has none; scrape nginx's own stub_status if needed

        location = / {{                    # S3 lists in XML, not the relay's JSON: list through a deltarl relay
            return 501 "listings need a deltarl relay in front of the bucket\\n";
        }}"""
    else:
        health = f"""    location ~ ^/(healthz|metrics)$ {{   # never cached: a health check must fail once the relay dies
            {common}
            proxy_cache off;
            add_header Cache-Control "no-store" always;
        }}

        location = / {{                    # listings: GET /?prefix=P, keyed by the whole URI, 1 s only
            {common}
            proxy_cache deltarl;
            proxy_cache_key "$request_method|$request_uri";
            proxy_ignore_headers Cache-Control Expires Set-Cookie;
            proxy_cache_valid 200 1s;
            proxy_cache_lock on;
            add_header Cache-Control "no-cache" always;
            add_header X-Cache-Status $upstream_cache_status always;
            limit_except GET {{ deny all; }}
        }}"""
    return f"""# nginx.conf for a deltarl relay cache. Generated by:
#   deltarl nginx-config --upstream {cfg.upstream} --listen {cfg.listen} --cache-dir {cfg.cache_dir}{' --bucket-endpoint' if cfg.bucket else ''}
# Regenerate instead of editing (the rules are explained in deltarl/relay/nginx.py).
# Run: nginx -p {cache}/ -c <this file>   (as root, workers run as nginx's default user)

worker_processes auto;
pid {cache}/nginx.pid;
error_log stderr warn;

events {{
    worker_connections 4096;
}}

http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_timeout 75s;
    client_body_temp_path {cache}/temp-body;
    proxy_temp_path {cache}/temp-proxy;
    fastcgi_temp_path {cache}/temp-fastcgi;
    uwsgi_temp_path {cache}/temp-uwsgi;
    scgi_temp_path {cache}/temp-scgi;
    proxy_cache_path {cache}/cache levels=1:2 keys_zone=deltarl:{cfg.keys_zone_mb}m max_size={cfg.max_size} inactive=30d use_temp_path=off;

    # Only a whole 200 or 206 is immutable; an error (404: not uploaded yet) never is.
    map $status $deltarl_cache_control {{
        200     "{IMMUTABLE}";
        206     "{IMMUTABLE}";
        default "no-store";
    }}

    upstream deltarl_upstream {{
        server {netloc};
        keepalive 32;
    }}

    server {{
        listen {cfg.listen};

{health}

        location ~ ^/[^/]+/(HEAD|WRITER)$ {{   # the mutable pointers: a 1 s micro-cache
            {rewrite}
            {common}
            proxy_cache deltarl;
            proxy_cache_key "$request_method|$uri";
            proxy_ignore_headers Cache-Control Expires Set-Cookie;   # the upstream says no-cache
            proxy_cache_valid 200 1s;
            proxy_cache_valid 404 1s;
            proxy_cache_lock on;                                     # one upstream request per second
            proxy_cache_use_stale updating;
            add_header Cache-Control "no-cache" always;
            add_header X-Cache-Status $upstream_cache_status always;
            limit_except GET {{ deny all; }}
        }}

        location / {{                      # everything else is immutable
            {rewrite}
            {common}
            proxy_cache deltarl;
            proxy_cache_key "$uri";
            proxy_ignore_headers Cache-Control Expires Set-Cookie;
            proxy_cache_valid 200 365d;                              # errors are not cached at all
            proxy_cache_lock on;                                     # concurrent misses share one fetch
            proxy_cache_lock_timeout 300s;                           # large keyframes take a while on a WAN
            proxy_cache_lock_age 300s;
            proxy_buffering on;
            proxy_max_temp_file_size 0;
            add_header Cache-Control $deltarl_cache_control always;
            add_header X-Cache-Status $upstream_cache_status always;
            limit_except GET {{ deny all; }}
        }}
    }}
}}
"""
