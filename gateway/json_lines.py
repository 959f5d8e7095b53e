"""JSON for the gateway's line-based formats (server-sent events, JSONL batch files): a JSON
text with the three characters JSON leaves as they are but line readers break lines at
(U+0085, U+2028, U+2029; Python's `str.splitlines` and httpx's `aiter_lines`, which follow it)
written as `\\u` escapes, the same JSON value on one line whatever the reader.

Bytes in, bytes out; it never parses or builds JSON.
"""

from __future__ import annotations

import re

# In UTF-8 these sequences are those characters wherever they occur; JSON's own syntax is
# ASCII, so in a JSON text they lie inside strings, where an escape means the same character.
_LINE_BREAKS = re.compile(rb"\xc2\x85|\xe2\x80[\xa8\xa9]")
_ESCAPES = {b"\xc2\x85": rb"\u0085", b"\xe2\x80\xa8": rb"\u2028", b"\xe2\x80\xa9": rb"\u2029"}


def one_line(json_text: bytes) -> bytes:
    """`json_text` (UTF-8) with U+0085, U+2028 and U+2029 escaped."""
    if b"\xc2\x85" not in json_text and b"\xe2\x80" not in json_text:
        return json_text  # most texts: two scans, no copy
    return _LINE_BREAKS.sub(lambda found: _ESCAPES[found.group()], json_text)
