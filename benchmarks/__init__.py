"""kvstore's benchmark suite: ``python -m benchmarks [--quick] [--only NAME ...] [--out DIR]``.

Benchmarks (one module each): ``ttft``, ``bandwidth``, ``agent_loop``, ``overhead``,
``scale``, ``shared``, ``server``, ``serve``, ``long_entry``. See benchmarks/README.md.
"""

BENCHMARKS = ("ttft", "bandwidth", "agent_loop", "overhead", "scale", "shared", "server", "serve", "long_entry")
