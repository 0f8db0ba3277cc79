"""API keys and the tenants they name (`--api-keys FILE`), and each tenant's requests in flight.

The file is JSON:
`{"keys": {"KEY": {"tenant": "acme", "class": "batch", "max_in_flight": 8,
"tokens_per_minute": 200000}}}`.
`tenant` is required; `class` is the default service class of the key's requests (a request's
own field still wins); `max_in_flight` bounds the tenant's requests from admission to their
end; `tokens_per_minute` its prompt and output tokens over the last 60 seconds (a prompt is
counted when admitted, output tokens as they are generated). Past either, a request gets a 429
with Retry-After. Keys are compared in constant time and never logged or echoed; errors name a
key by its position in the file.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import time
from collections import Counter, deque
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from gapless.engine.sampling_params import SERVICE_CLASSES

log = logging.getLogger("gapless.server")


@dataclass(frozen=True)
class Tenant:
    name: str
    service_class: str | None = None
    max_in_flight: int | None = None
    tokens_per_minute: int | None = None


TOKEN_WINDOW_S = 60.0  # tokens_per_minute's window
# The tenant of the request being served (endpoint() sets it once the key is checked): its
# parse reads the default class, admission its name and limit.
CALLER: ContextVar[Tenant | None] = ContextVar("gapless_caller", default=None)


class KeyFileError(ValueError):
    pass


class OverLimit(RuntimeError):
    """A tenant's request past one of its limits (the server answers 429): retry_after_s says
    when it may be admitted."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


LIMITS = ("max_in_flight", "tokens_per_minute")


def read_key_file(path: Path) -> dict[bytes, Tenant]:
    """The file's keys and their tenants; KeyFileError says what is wrong, never with a key."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KeyFileError(f"{path}: cannot read it as JSON: {e}") from e
    keys = raw.get("keys") if isinstance(raw, dict) else None
    if not isinstance(keys, dict) or not keys:
        raise KeyFileError(f'{path}: expected {{"keys": {{"KEY": {{"tenant": ...}}, ...}}}}')
    tenants = {}
    for position, (key, entry) in enumerate(keys.items(), 1):
        where = f"{path}: key {position}"
        if not key or not isinstance(entry, dict):
            raise KeyFileError(f"{where}: an empty key, or its entry is not an object")
        if unknown := set(entry) - {"tenant", "class", *LIMITS}:
            raise KeyFileError(f"{where}: unknown fields {sorted(unknown)}")
        name = entry.get("tenant")
        if not isinstance(name, str) or not name:
            raise KeyFileError(f"{where}: tenant must be a non-empty string")
        service_class = entry.get("class")
        if service_class is not None and service_class not in SERVICE_CLASSES:
            raise KeyFileError(f"{where}: class must be one of {', '.join(SERVICE_CLASSES)}")
        for limit in LIMITS:
            value = entry.get(limit)
            if value is not None and (type(value) is not int or value < 1):
                raise KeyFileError(f"{where}: {limit} must be a positive integer")
        limits = {limit: entry.get(limit) for limit in LIMITS}
        tenants[key.encode()] = Tenant(name, service_class, **limits)
    return tenants


class Tenants:
    """The key file's tenants, reread on reload() (SIGHUP), and their requests in flight."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._keys = read_key_file(self.path)
        self._in_flight: Counter[str] = Counter()
        self._spent: dict[str, deque[tuple[float, int]]] = {}  # (when, tokens) in the window
        self.finished: Counter[str] = Counter()  # requests ended, by tenant (/metrics)

    def identify(self, given: str) -> Tenant | None:
        """The tenant of a key, or None; every key is compared, in constant time each."""
        found = None
        for key, tenant in self._keys.items():
            if hmac.compare_digest(given.encode(), key):
                found = tenant
        return found

    def reload(self) -> None:
        """Rereads the file: a good one serves new requests from now on; a bad one is logged
        and the keys in force stay. Counts in flight are kept."""
        try:
            self._keys = read_key_file(self.path)
        except KeyFileError as e:
            log.error("--api-keys not reloaded, the keys in force stay: %s", e)
            return
        log.info("--api-keys reloaded: %d keys", len(self._keys))

    def named(self, name: str) -> Tenant | None:
        """The tenant of that name as the keys in force give it (the first key's, where
        several name it), or None."""
        return next((t for t in self._keys.values() if t.name == name), None)

    @property
    def names(self) -> list[str]:
        return sorted({tenant.name for tenant in self._keys.values()})

    def admit(self, tenant: Tenant, prompt_tokens: int) -> None:
        """Counts a request in flight and its prompt's tokens spent, or raises OverLimit past
        one of the tenant's limits. A prompt larger than tokens_per_minute alone is admitted
        once the window is empty: it could never be otherwise."""
        limit = tenant.max_in_flight
        if limit is not None and self._in_flight[tenant.name] >= limit:
            raise OverLimit(
                f"tenant {tenant.name!r} has {limit} requests in flight, its limit; retry when "
                "one ends"
            )
        rate = tenant.tokens_per_minute
        if rate is not None:
            now = time.monotonic()
            spent = self._spent.setdefault(tenant.name, deque())
            while spent and spent[0][0] <= now - TOKEN_WINDOW_S:
                spent.popleft()
            total = sum(tokens for _, tokens in spent)
            if total and total + prompt_tokens > rate:
                raise OverLimit(
                    f"tenant {tenant.name!r} has used {total} of its {rate} tokens per minute;"
                    f" this prompt has {prompt_tokens}",
                    self._retry_after(spent, total + prompt_tokens - rate, now),
                )
        self._in_flight[tenant.name] += 1
        self.spend(tenant, prompt_tokens)

    @staticmethod
    def _retry_after(spent: deque[tuple[float, int]], excess: int, now: float) -> int:
        """Whole seconds until the window has dropped `excess` tokens (or all of them)."""
        when, dropped = spent[-1][0], 0  # all of them, for a prompt over the limit alone
        for at, tokens in spent:
            dropped += tokens
            if dropped >= excess:
                when = at
                break
        return max(1, math.ceil(when + TOKEN_WINDOW_S - now))

    def spend(self, tenant: Tenant, tokens: int) -> None:
        """Counts tokens against the tenant's tokens_per_minute (where it has one)."""
        if tenant.tokens_per_minute is not None:
            self._spent.setdefault(tenant.name, deque()).append((time.monotonic(), tokens))

    def ended(self, tenant: Tenant) -> None:
        self.finished[tenant.name] += 1
        self._in_flight[tenant.name] -= 1
        if not self._in_flight[tenant.name]:
            del self._in_flight[tenant.name]

    def in_flight(self, name: str) -> int:
        return self._in_flight[name]
