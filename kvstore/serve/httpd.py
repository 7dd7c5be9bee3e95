"""kvstore's own ``run()`` for mlx_lm.server: the prompt cache, the generator and a
``ThreadingHTTPServer`` serving kvstore's handler, built from the module's names.

mlx-lm's ``run()`` hands its HTTP server the ``APIHandler`` it was defined with, whatever
the module names later; ``server.patch`` names this ``run`` there instead (mlx_lm.server's
``main()`` calls it by name, after reading its own flags), so that
``kvstore serve`` serves kvstore's subclasses. What it does is mlx-lm's (0.32): on rank 0
the HTTP server on the first address ``getaddrinfo`` gives for ``host:port``, one thread
per connection, until KeyboardInterrupt (``kvstore serve``'s SIGTERM) shuts it down and
stops the generation thread; on other ranks of a distributed group, the generation thread
only. A bind error (a port in use) is raised to the caller, as mlx-lm's is.
"""

from __future__ import annotations

import logging
import socket
from http.server import ThreadingHTTPServer
from typing import Any, Callable


def runner(server_mod: Any) -> Callable[..., None]:
    """``run(host, port, model_provider, server_class=ThreadingHTTPServer, handler_class=None)``
    for ``server_mod`` (mlx_lm.server): its ``LRUPromptCache``, ``ResponseGenerator`` and
    (unless ``handler_class`` is given) ``APIHandler``, read when it runs."""

    def run(host: str, port: int, model_provider: Any, server_class: type = ThreadingHTTPServer,
            handler_class: Any = None) -> None:
        import mlx.core as mx

        group = mx.distributed.init()
        prompt_cache = server_mod.LRUPromptCache(model_provider.cli_args.prompt_cache_size)
        generator = server_mod.ResponseGenerator(model_provider, prompt_cache)
        if group.rank() != 0:
            generator.join()
            return
        serve(host, port, generator, handler_class or server_mod.APIHandler, server_class,
              server_mod.get_system_fingerprint)

    return run


def serve(host: str, port: int, generator: Any, handler_class: Any, server_class: type = ThreadingHTTPServer,
          fingerprint: Callable[[], str] | None = None) -> None:
    """Serve ``handler_class(generator, ...)`` on ``host:port`` until KeyboardInterrupt, then
    shut the HTTP server down and stop ``generator``'s thread."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    bound = type(server_class.__name__, (server_class,), {"address_family": family})  # the stdlib class untouched

    def handler(*args: Any, **kwargs: Any) -> Any:
        return handler_class(generator, *args, system_fingerprint=fingerprint() if fingerprint else None, **kwargs)

    httpd = bound(address, handler)
    logging.info(f"Starting httpd at {host} on port {port}...")
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        httpd.shutdown()
        generator.stop_and_join()
    finally:
        httpd.server_close()
