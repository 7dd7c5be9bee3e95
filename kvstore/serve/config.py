"""``ServeConfig``: everything ``kvstore serve``'s flags decided, one frozen value built once
from the command line (``ServeConfig.from_args``) and handed to the handler, the generator
and the start: no module global is written at run time."""

from __future__ import annotations

import dataclasses

import argparse
from dataclasses import dataclass, field
from typing import Any

from ..options import DROP_IN, StoreOptions
from . import stable_prefix, startup, tenants
from .http import MAX_BODY_BYTES
from .responses import DEFAULT_MAX_BYTES as RESPONSES_MAX_BYTES, DEFAULT_MAX_COUNT as RESPONSES_MAX_COUNT


@dataclass(frozen=True)
class ServeConfig:
    """What ``kvstore serve``'s flags decided. ``store``: the settings of its prompt cache,
    the drop-in's (``options.DROP_IN``) with what the flags set; the default (an engine's
    ``patch``, the upstream gate) is the drop-in's own."""

    store: StoreOptions = DROP_IN
    policy: tenants.Policy = field(default_factory=tenants.Policy)
    stable: stable_prefix.Config = field(default_factory=stable_prefix.Config)
    start: startup.Options = field(default_factory=startup.Options)
    max_body_bytes: int = MAX_BODY_BYTES
    keep_billing_header: bool = False
    sort_tools: bool = False
    served_names: tuple[str, ...] = ()
    strict_model_names: bool = False
    responses_max_count: int = RESPONSES_MAX_COUNT
    responses_max_bytes: int = RESPONSES_MAX_BYTES

    @classmethod
    def from_args(cls, ours: argparse.Namespace, policy: tenants.Policy,
                  rules: tuple[stable_prefix.Rule, ...] | None = None) -> ServeConfig:
        """The config of kvstore's own flags (``server.setup_arg_parser`` and the groups it
        adds); ValueError naming a bad ``--volatile`` pattern (``rules``: those already
        compiled from them); SystemExit for a bad ``--shared-*`` flag (``shared_config``)."""
        shared = shared_config(ours)
        store = DROP_IN.but(
            cache_dir=ours.cache_dir, max_disk_bytes=ours.max_disk_bytes, chunk_tokens=ours.chunk_tokens,
            queue_size=ours.write_queue, persist=ours.persist, max_write_bytes_per_day=ours.max_write_bytes_per_day,
            memory_floor=ours.memory_floor, min_disk_hit=ours.min_disk_hit,
            min_memory_hit=ours.min_disk_hit,  # one rule for every tier in the usage it reports
            shared=shared)
        stable = stable_prefix.Config.from_flags(not ours.no_stable_prefix, ours.volatile,
                                                 learn=not ours.no_learned_spans,
                                                 max_count=ours.stable_prefix_max_count,
                                                 max_bytes=ours.stable_prefix_max_bytes, rules=rules)
        return cls(
            store=store, policy=policy, stable=stable,
            start=dataclasses.replace(startup.options(ours), said=(stable.said(),)), max_body_bytes=ours.max_body_bytes,
            keep_billing_header=ours.keep_billing_header, sort_tools=ours.sort_tools,
            served_names=tuple(n for n in ours.served_model_name if n),
            strict_model_names=bool(ours.strict_model_names),
            responses_max_count=ours.responses_max_count, responses_max_bytes=ours.responses_max_bytes)


def shared_config(ours: argparse.Namespace) -> Any:
    """The SharedConfig of ``--shared`` and its options (``$KVSTORE_SHARED`` when only the
    options are given), or None: the store then reads ``$KVSTORE_SHARED`` itself."""
    timeout = ours.shared_timeout  # seconds (units.milliseconds)
    secret = getattr(ours, "shared_secret_file", None)
    from ..shared.config import read_secret

    try:
        secret = read_secret(secret) if secret else None
    except ValueError as e:
        raise SystemExit(f"kvstore serve: {e}") from None
    over: dict[str, Any] = {k: v for k, v in (("prefix", ours.shared_prefix), ("ttl", ours.shared_ttl),
                              ("command_timeout", timeout), ("secret", secret)) if v is not None}
    if ours.shared is None and not over:
        return None
    from ..shared import SharedConfig

    config = SharedConfig.from_url(ours.shared, **over) if ours.shared else SharedConfig.from_env(**over)
    if config is None:
        raise SystemExit("kvstore serve: --shared-* options need --shared URL (or $KVSTORE_SHARED)")
    return config
