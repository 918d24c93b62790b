"""``deltarl nginx-config``: the checked-in infra/nginx-relay.conf is its output; bad input is refused."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from deltarl.cli import main
from deltarl.commands.nginx_config import EXAMPLE_ARGS
from deltarl.errors import ConfigError
from deltarl.relay.nginx import NginxRelayConfig, nginx_config

REPO = Path(__file__).resolve().parents[3]


def test_infra_file_is_the_generators_output() -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["nginx-config", *EXAMPLE_ARGS]) == 0
    assert (REPO / "infra" / "nginx-relay.conf").read_text() == out.getvalue(), (
        "infra/nginx-relay.conf is stale: regenerate it with `deltarl nginx-config " + " ".join(EXAMPLE_ARGS) + "`")


def test_rules_present() -> None:
    text = nginx_config(NginxRelayConfig("http://relay:8470", listen="127.0.0.1:9000", cache_dir="/c"))
    assert "proxy_ignore_headers Cache-Control" in text
    assert 'proxy_cache_key "$request_method|$request_uri";' in text  # listings: the full URI
    assert "listen 127.0.0.1:9000;" in text
    assert "rewrite ^/(.*)$ /$1? break;" in text  # the query is dropped for objects
    bucket = nginx_config(NginxRelayConfig("http://s3:8333/bkt/pre/fix", bucket=True))
    assert "rewrite ^/(.*)$ /bkt/pre/fix/$1? break;" in bucket
    assert "proxy_set_header Host s3:8333;" in bucket


@pytest.mark.parametrize(("upstream", "bucket", "listen", "match"), [
    ("relay:8470", False, "0.0.0.0:1", "http"),
    ("http://relay:8470/path", False, "0.0.0.0:1", "bucket-endpoint"),
    ("http://s3:9000", True, "0.0.0.0:1", "bucket in its path"),
    ("http://relay:8470", False, "8470", "HOST:PORT"),
    ("http://relay:8470", False, "0.0.0.0:99999", "HOST:PORT"),
    ("http://relay:8470?x=1", False, "0.0.0.0:1", "query"),
])
def test_bad_input_is_refused(upstream: str, bucket: bool, listen: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        nginx_config(NginxRelayConfig(upstream, listen=listen, bucket=bucket))
