"""``kvstore serve``: mlx_lm.server with kvstore's prompt cache and the APIs agents speak.

The engine adapter it serves through is ``kvstore.adapters.mlx_lm`` (the drop-in
``LRUPromptCache``); everything here is about requests: the server (``server``: ``patch`` names kvstore's
subclasses in mlx_lm.server; ``config``: the flags' ``ServeConfig``; ``handler``: the
routes; ``generator``: the prompt steps; ``context``: one request's facts; ``httpd``: the
HTTP server), routes (``http``, ``openapi``, ``startup``), callers (``tenants``, ``model_names``), prompts (``prompts``,
``rendered``, ``system_render``, ``stable_prefix``) and the translated APIs (``anthropic``,
``responses`` with ``response_store`` / ``response_record``, ``chat_route``, ``gen_args``).
"""
