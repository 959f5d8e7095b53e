"""Secrets that guard Folio's APIs: the gateway's API keys and the internal token the engine and
tokenizer services may require of their callers, both sent as `authorization: Bearer <key>`
(an HTTP header, or gRPC call metadata).

An API key may come with settings of its own, after it on its line of the key file (and in
FOLIO_API_KEYS, which carries the same entries): `KEY tenant=NAME weight=W slo_ttft_ms=MS
slo_total_ms=MS`, each optional (KeySettings).

Keys are kept only as SHA-256 digests, and a presented key is compared with every one of them
by hmac.compare_digest without stopping at a match: neither a key's content, nor its length,
nor which key matched shows in the time a check takes. This module never logs or formats a
key; its errors say where a bad key came from, never the key.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from common.config import API_KEYS_ENV, INTERNAL_TOKEN_ENV

AUTHORIZATION = "authorization"  # the HTTP header and the gRPC metadata key


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class KeySettings:
    """What an API key's requests get unless they say otherwise: the tenant they are served
    as under the fair scheduling policy (None: the key's own name), its weight, and default
    deadlines (milliseconds) for the first token and the end."""

    tenant: str | None = None
    weight: float = 1.0
    slo_ttft_ms: float | None = None
    slo_total_ms: float | None = None


def key_of(entry: str) -> str:
    """The key of a key entry (`KEY setting=value ...`)."""
    return entry.split(None, 1)[0] if entry.strip() else ""


def key_settings(entry: str, source: str = "API key") -> KeySettings:
    """The settings of a key entry; ValueError naming `source` and the setting when one is
    unknown or out of range. Never includes the key in a message."""
    values: dict[str, str | float] = {}
    for item in entry.split()[1:]:
        name, equals, value = item.partition("=")
        if not equals or name not in KeySettings.__dataclass_fields__:
            raise ValueError(
                f"{source}: {item!r} after the key is not one of tenant=, weight=, "
                "slo_ttft_ms=, slo_total_ms="
            )
        if name == "tenant":
            values[name] = value
            continue
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not (number > 0 and math.isfinite(number)):
            raise ValueError(f"{source}: {name} must be a positive number, got {value!r}")
        values[name] = number
    return KeySettings(**values)  # type: ignore[arg-type]


class KeySet:
    """The keys that grant access; empty means access is open. Built from key entries (a key
    and its settings): only the keys are kept, as digests."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._digests = tuple(dict.fromkeys(_digest(key_of(k)) for k in keys))

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __repr__(self) -> str:
        return f"KeySet({len(self._digests)} keys)"

    def identify(self, presented: str | None) -> str | None:
        """A name for the key presented ("key-2", never the key itself) if it is one of the
        set, else None; in time independent of the keys."""
        if presented is None:
            return None
        digest = _digest(presented)
        found = -1
        for index, known in enumerate(self._digests):
            if hmac.compare_digest(digest, known):
                found = index
        return None if found < 0 else f"key-{found}"


def bearer_token(authorization: str | None) -> str | None:
    """The credential of an `authorization: Bearer <token>` value; None for anything else."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _check_key(entry: str, source: str) -> str:
    # Keys travel in a header and in a comma-separated variable: visible ASCII, no commas.
    key = key_of(entry)
    if not key or not all("!" <= c <= "~" and c != "," for c in entry.strip() if c != " "):
        raise ValueError(f"{source}: an API key must be printable ASCII without spaces or commas")
    key_settings(entry, source)
    return " ".join(entry.split())


def load_api_keys(
    flag_keys: Sequence[str] = (),
    key_file: str | None = None,
    environ: Mapping[str, str] = os.environ,
) -> tuple[str, ...]:
    """The gateway's API key entries (each a key and its settings, `KEY name=value ...`):
    --api-key values, FOLIO_API_KEYS (comma-separated) and the lines of --api-key-file (blank
    lines and # comments skipped); a key given twice counts once, as first given. ValueError
    names a bad entry's source."""
    keys = [_check_key(k, f"--api-key #{i + 1}") for i, k in enumerate(flag_keys)]
    keys += [
        _check_key(k.strip(), API_KEYS_ENV)
        for k in environ.get(API_KEYS_ENV, "").split(",")
        if k.strip()
    ]
    if key_file is not None:
        for number, line in enumerate(Path(key_file).read_text().splitlines(), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(_check_key(line, f"{key_file} line {number}"))
        if not keys:
            raise ValueError(f"--api-key-file {key_file} holds no key")
    first: dict[str, str] = {}
    for entry in keys:
        first.setdefault(key_of(entry), entry)
    return tuple(first.values())


def internal_token(environ: Mapping[str, str] = os.environ) -> str | None:
    """The internal services' shared token (FOLIO_INTERNAL_TOKEN), None when unset."""
    return environ.get(INTERNAL_TOKEN_ENV) or None


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata presenting `token` (none for None)."""
    return ((AUTHORIZATION, f"Bearer {token}"),) if token else ()


def grpc_presented_key(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The bearer token in gRPC call metadata, if any."""
    for key, value in metadata or ():
        if key == AUTHORIZATION and isinstance(value, str):
            return bearer_token(value)
    return None


_HANDLER_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class KeyInterceptor(grpc.aio.ServerInterceptor):
    """Ends every call that does not present one of `keys` with UNAUTHENTICATED, except calls
    to `open_services` (full service names, e.g. grpc.health.v1.Health)."""

    def __init__(self, keys: KeySet, what: str, open_services: Collection[str] = ()) -> None:
        self._keys = keys
        self._message = f"missing or invalid {what}: send metadata authorization: Bearer <key>"
        self._open_services = frozenset(open_services)

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(details)
        service = details.method.lstrip("/").split("/", 1)[0]
        if handler is None or service in self._open_services:
            return handler
        if self._keys.identify(grpc_presented_key(details.invocation_metadata)) is not None:
            return handler
        return self._refusal(handler)

    def _refusal(self, handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        """A handler of the same kind as `handler` (so the request is read as it would be) that
        ends the call with UNAUTHENTICATED."""

        async def refuse(
            request_or_iterator: object, context: grpc.aio.ServicerContext[Any, Any]
        ) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, self._message)

        factory = _HANDLER_FACTORIES[(handler.request_streaming, handler.response_streaming)]
        return factory(
            refuse,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
