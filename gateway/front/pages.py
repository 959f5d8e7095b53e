"""The web pages' files (gateway/front/webui/, package data, no build step): the playground at /,
the dashboard at /dashboard, and their scripts and style under /webui/<name>.

The files are read once, at start-up, into a table of exact paths: a request names one of them
or gets 404, so no request path ever reaches the file system. The pages load nothing from
elsewhere (their Content-Security-Policy allows this origin only). Serving files only: what the
pages show comes from the API and the dashboard feed.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

# The pages themselves; every other file of the folder is served under STATIC_PREFIX.
PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}
STATIC_PREFIX = "/webui/"
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
HEADERS = {
    # Scripts, styles, images and connections from this origin only: no inline script, no CDN.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Small files: always revalidated, so an upgraded server is never shown with old scripts.
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True)
class WebFile:
    content: bytes
    media_type: str


def _media_type(name: str) -> str:
    return MEDIA_TYPES[name[name.rindex(".") :]]


def load_web_files() -> dict[str, WebFile]:
    """Every file of gateway/front/webui/ by the URL path it is served at."""
    folder = resources.files("gateway.front") / "webui"
    names = sorted(
        entry.name
        for entry in folder.iterdir()
        if entry.is_file() and entry.name[entry.name.rfind(".") :] in MEDIA_TYPES
    )
    files = {STATIC_PREFIX + name: name for name in names if name not in PAGES.values()}
    files.update(PAGES)
    return {
        path: WebFile((folder / name).read_bytes(), _media_type(name))
        for path, name in sorted(files.items())
    }
