"""Choose the transport for ``distributed.repo_id``: the one module that knows both.

``transport`` defines the layout over five primitives; ``directory`` and ``hub`` implement
them and import ``transport``. Picking one by the repo id lives here, above all three, so no
module imports a module that imports it back.
"""

from __future__ import annotations

from typing import Any

from speedtronic.diloco.directory import DirectoryTransport
from speedtronic.diloco.hub import HubClient
from speedtronic.diloco.retry import RetryPolicy, retry_policy_from_config

__all__ = ["build_transport"]


def build_transport(
    config: Any, retry: RetryPolicy | None = None
) -> DirectoryTransport | HubClient:
    """``file:///abs`` -> :class:`DirectoryTransport`; ``owner/name`` -> :class:`HubClient`.

    ``config`` is the ``distributed`` section (``repo_id``, ``token``, ``cache_dir``,
    ``round_timeout`` and the retry settings); ``retry`` overrides the policy built from it.
    A Hub repository that answers "not found" is taken for one its master has not created
    yet for ``round_timeout`` seconds (what a worker waits for the first global), then for
    one the token cannot see (a permanent ``AccessRefused``).
    """
    retry = retry or retry_policy_from_config(config)
    repo_id = config.repo_id or ""
    if repo_id.startswith("file:"):
        return DirectoryTransport(repo_id, retry)
    return HubClient(
        repo_id,
        token=config.token,
        cache_dir=config.cache_dir,
        retry=retry,
        missing_repo_wait=float(config.round_timeout),
    )
