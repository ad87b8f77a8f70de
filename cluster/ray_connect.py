"""How raymoe's commands reach a Ray cluster: an address used exactly as given, token
authentication, and errors that say what happened.

- No address (and no RAY_ADDRESS): `raymoe serve` and `raymoe run-batch` start a Ray of their
  own (cluster/deploy.py ``ensure_ray``); they never attach to a cluster they happen to find
  on the machine (/tmp/ray/ray_current_cluster, a test's cluster, another user's).
- An explicit address (``--address HOST:PORT`` or RAY_ADDRESS) is used as given; ``auto`` only
  when asked for (it attaches to whatever Ray cluster this machine ran last).
- Token authentication (Ray 2.60): Ray sends the caller's token (RAY_AUTH_TOKEN,
  RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) by itself only to a cluster it found with
  ``auto``; to an address named explicitly it sends none unless RAY_AUTH_MODE=token, and the
  GCS then refuses with InvalidAuthToken. raymoe sets RAY_AUTH_MODE=token whenever a token
  is available and the variable is unset (a cluster without authentication ignores the
  token), so ``--address 10.0.0.1:6379`` works against a token-authenticated cluster.
- Before ``ray.init`` the GCS is asked once for a key: a refused token raises
  :class:`AuthenticationFailed` ("authentication failed: ..."), at once, instead of Ray's
  retries ending in "Failed to connect" (which the status command used to report as "no
  running raymoe deployment found").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

AUTH_MODE = "RAY_AUTH_MODE"


class ClusterUnreachable(ConnectionError):
    """No Ray cluster answered at the address (or ``auto`` found none)."""


class AuthenticationFailed(ClusterUnreachable):
    """The cluster answered and refused this process's token (or the lack of one)."""


def requested_address(address: str | None) -> str | None:
    """The address a command was given: ``--address``, else RAY_ADDRESS, else None."""
    return address or os.environ.get("RAY_ADDRESS") or None


def token_available() -> bool:
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return True
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").expanduser()
    try:
        return path.is_file() and path.stat().st_size > 0
    except OSError:
        return False


def use_token_if_available() -> bool:
    """Set RAY_AUTH_MODE=token when it is unset and a token is available (see the module
    docstring). Returns whether token authentication is on for this process."""
    mode = os.environ.get(AUTH_MODE)
    if mode is not None:
        return mode.lower() == "token"
    if not token_available():
        return False
    os.environ[AUTH_MODE] = "token"
    try:  # Ray caches its config in C++: re-read the environment, as Ray itself does
        from ray._raylet import Config

        Config.initialize("")
    except Exception:
        pass
    return True


def _gcs_address(address: str) -> str:
    from ray._private import services

    try:
        resolved = services.canonicalize_bootstrap_address(address)
    except (ConnectionError, ValueError) as error:
        raise ClusterUnreachable(f"no Ray cluster at {address}: {error}") from None
    if resolved is None:
        raise ClusterUnreachable(f"no running Ray cluster found for address {address!r}")
    return resolved


def _is_auth_error(error: BaseException) -> bool:
    from ray.exceptions import AuthenticationError

    return isinstance(error, AuthenticationError) or "InvalidAuthToken" in str(error) \
        or "Unauthenticated" in str(error)


def check_gcs(address: str, timeout_s: float = 30.0) -> str:
    """Ask the GCS at ``address`` for a key; raise AuthenticationFailed if it refuses us,
    ClusterUnreachable if nothing answers. Returns the resolved host:port."""
    gcs = _gcs_address(address)
    try:
        from ray._raylet import GcsClient
    except ImportError:  # a Ray without it: let ray.init speak
        return gcs
    try:
        GcsClient(address=gcs).internal_kv_get(b"__raymoe_probe__", None, timeout=timeout_s)
    except Exception as error:
        if _is_auth_error(error):
            raise AuthenticationFailed(_auth_message(gcs, error)) from None
        raise ClusterUnreachable(f"no Ray cluster answers at {gcs}: {error}") from None
    return gcs


def _auth_message(gcs: str, error: BaseException) -> str:
    text = str(error).split(". Ensure that")[0].strip()
    text = text.split(" Note: RAY_AUTH_MODE")[0]
    mode = os.environ.get(AUTH_MODE, "unset")
    if mode.lower() == "token":
        where = os.environ.get("RAY_AUTH_TOKEN_PATH") or ("RAY_AUTH_TOKEN" if os.environ.get("RAY_AUTH_TOKEN")
                                                           else "~/.ray/auth_token")
        sent = f"refused this client's token from {where}"
    else:
        sent = f"wants a token and this client sends none (RAY_AUTH_MODE={mode})"
    return (f"authentication failed: the Ray cluster at {gcs} {sent} ({text}). Use the cluster's token: "
            f"copy its ~/.ray/auth_token here, or set RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN")


def connect(address: str, **init_kwargs: Any) -> None:
    """``ray.init(address=address, ...)`` for an address given explicitly, with the token
    and the error handling described above."""
    import ray

    use_token_if_available()
    check_gcs(address)
    try:
        ray.init(address=address, **init_kwargs)
    except Exception as error:
        if _is_auth_error(error):
            raise AuthenticationFailed(_auth_message(address, error)) from None
        if isinstance(error, ConnectionError):
            raise ClusterUnreachable(f"could not connect to the Ray cluster at {address}: {error}") from None
        raise
