"""Database URLs as the store and the Optuna storage take them: where the store URL comes from
(`--store`, else $HEXISEQ_STORE_URL, else the default), parsing with a one-line error, and
masking every password before a URL is printed, logged, put in an error or shown on a page.

A password reaches a child process only through its environment (`child_environment`), never
its argv: the process list shows argv to every user of the machine.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from hexiseq.errors import InputError

DEFAULT_STORE_URL = "sqlite:///hexiseq.db"
STORE_URL_ENV = "HEXISEQ_STORE_URL"
"""Environment variable naming the store when `--store` (Python: `url=`) is not given."""
OPTUNA_STORAGE_ENV = "HEXISEQ_DASHBOARD_OPTUNA_STORAGE"
"""How `hexiseq dashboard --optuna-storage URL` hands the Optuna storage URL to the app (in its
environment, like the store's)."""
STORE_URL_HELP = f"(default ${STORE_URL_ENV}, else {DEFAULT_STORE_URL})"
"""What the `--store` options' help says about their default."""

MASK = "***"
# `scheme://USER:PASSWORD@`, the scheme optional (a mistyped URL may lack it), at the start of a
# word: the password runs to the last "@" of the word, as a careless `u:p@ss@host` would have it;
# over-masking a port or path of a malformed URL is the safe side.
_USERINFO_PASSWORD = re.compile(
    r"(?<![\w+.\-:/@])(?P<head>(?:[A-Za-z][\w+.\-]*://)?[^:/@\s'\"`<>()\[\],]*)"
    r":(?!//)[^\s'\"`<>]*@"
)
# `?password=...` in the query string, which the database drivers read as well.
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&](?:password|passwd|pwd)=)[^&\s'\"]*", re.IGNORECASE)


def store_url_from(argument: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The store URL: `argument` (`--store`) when given, else $HEXISEQ_STORE_URL when set and
    not empty, else `DEFAULT_STORE_URL`. `environ` defaults to `os.environ`."""
    if argument is not None:
        return argument
    environ = os.environ if environ is None else environ
    return environ.get(STORE_URL_ENV) or DEFAULT_STORE_URL


def child_environment(store_url: str | None, **extra: str) -> dict[str, str]:
    """This process's environment for a child, with $HEXISEQ_STORE_URL set to `store_url`
    (left as it is when None) and the `extra` variables set."""
    environment = dict(os.environ)
    if store_url is not None:
        environment[STORE_URL_ENV] = store_url
    environment.update(extra)
    return environment


def mask_url_passwords(text: str) -> str:
    """`text` with the password of every URL in it shown as `***`: the `USER:PASSWORD@` part
    and a `password=` query parameter, also in a URL that SQLAlchemy cannot parse."""
    masked = _USERINFO_PASSWORD.sub(rf"\g<head>:{MASK}@", text)
    return _QUERY_PASSWORD.sub(rf"\g<head>{MASK}", masked)


def display_url(url: URL | str) -> str:
    """A URL (parsed or as text) as it may be shown: every password masked."""
    if isinstance(url, URL):
        url = url.render_as_string(hide_password=True)
    return mask_url_passwords(url)


def parse_database_url(url: object, what: str, allowed: str) -> URL:
    """Parse `url` as a SQLAlchemy URL; InputError (`what` names it, `allowed` says what is
    accepted, the password masked) when it is not a string or cannot be parsed."""
    if not isinstance(url, str):
        raise InputError(f"{what} must be a URL string, got {type(url).__name__}; {allowed}")
    try:
        return make_url(url)
    except (ArgumentError, TypeError, ValueError):
        raise InputError(f"{what} {display_url(url)!r} cannot be parsed; {allowed}") from None
