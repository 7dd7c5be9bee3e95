"""``ServeConfig``: everything ``kvstore serve``'s flags decided, one frozen value built once
from the command line (``ServeConfig.from_args``) and handed to the handler, the generator
and the start: no module global is written at run time."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from ..options import StoreOptions
from . import stable_prefix, startup, tenants
from .http import MAX_BODY_BYTES
from .responses import DEFAULT_MAX_BYTES as RESPONSES_MAX_BYTES, DEFAULT_MAX_COUNT as RESPONSES_MAX_COUNT


@dataclass(frozen=True)
class ServeConfig:
    store: StoreOptions = field(default_factory=StoreOptions)
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
    def from_args(cls, ours: argparse.Namespace, policy: tenants.Policy) -> ServeConfig:
        """The config of kvstore's own flags (``server.setup_arg_parser`` and the groups it
        adds); ValueError naming a bad ``--volatile`` pattern."""
        raise NotImplementedError  # the handler helper fills this in from server._install
