"""Raw HTTP/1.1 over a socket for fuzz tests: paths and headers go out exactly as generated."""

from __future__ import annotations

import socket

from hypothesis import strategies as st

PATH_CHARS = st.sampled_from([*"abcrv0123456789/.-_~%:+ ", "%2e", "%2f", "%00", "%ff", "%c3%28", "%25", "..", "//"])
PATHS = st.lists(PATH_CHARS, max_size=40).map(lambda parts: "/" + "".join(parts).replace(" ", "%20"))
TOKENS = st.one_of(st.none(), st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=40))
NUMBERS = st.one_of(st.integers(min_value=-5, max_value=10**6).map(str), st.text("0123456789", min_size=1, max_size=60))
RANGES = st.one_of(
    st.none(),
    st.builds(lambda a, b: f"bytes={a}-{b}", st.one_of(st.just(""), NUMBERS), st.one_of(st.just(""), NUMBERS)),
    st.builds(lambda a, b: f"bytes={a}-{b},{b}-", NUMBERS, NUMBERS),
    st.sampled_from(["items=0-5", "bytes=", "bytes=-", "bytes=x-y", "bytes 0-5", "=", "bytes=-0"]),
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=30),
)


def request(port: int, method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b"",
            timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """Send one request (``Connection: close``); return status, headers (lower-case) and body."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    raw = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        chunks = []
        while True:
            data = s.recv(1 << 16)
            if not data:
                break
            chunks.append(data)
    resp = b"".join(chunks)
    head, _, payload = resp.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    hdrs = {}
    for line in header_lines:
        k, _, v = line.partition(":")
        hdrs[k.strip().lower()] = v.strip()
    if hdrs.get("transfer-encoding", "").lower() == "chunked":
        payload = _unchunk(payload)
    return int(status_line.split()[1]), hdrs, payload


def _unchunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return bytes(out)
