"""``RequestContext``: what one request of ``kvstore serve`` carries from its HTTP thread to
mlx_lm.server's generation thread, in place of thread-locals.

The handler (``kvstore.serve.handler``) makes one per request when its headers are read
(the caller's salt: ``cache_salt`` and, under ``--isolate-keys``, the key's) and hands its
routes a view of the generator (``RequestView``) whose ``generate`` attaches the context to
the CompletionRequest it queues. On the generation thread ``_tokenize``
(``kvstore.serve.generator``) reads the salt, writes what it rendered and what
``--stable-prefix`` moved, and returns the prompt as ``RequestTokens``: the token list
the prompt cache then looks up, carrying the context, so the miss line of that lookup
names the request's own render and rewrite (``name_part`` / ``miss_note``). Nothing is kept
per thread: a context reaches only the code handed the request or its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from ..salt import Salt, SaltedTokens

if TYPE_CHECKING:
    from ..misses import Miss
    from ..parts import Part
    from .rendered import Rendered
    from .stable_prefix import Moved

ATTRIBUTE = "kvstore_context"  # of a CompletionRequest instance (never of its class)


@dataclass
class RequestContext:
    """One request's facts: ``salt`` (set when it is admitted); ``rendered`` and ``moved``
    (set by the generation thread's ``_tokenize``: the chat request as rendered, what
    ``--stable-prefix`` moved)."""

    salt: Salt | None = None
    rendered: Rendered | None = None
    moved: Moved | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with its salt only (mlx_lm.server shares a distributed group's requests so;
        the render holds the tokenizer and is the generating rank's own)."""
        return {"salt": self.salt, "rendered": None, "moved": None}

    def note(self) -> str:
        """``; <what moved>`` for the miss line of this request's lookup ("" when nothing moved)."""
        return f"; {self.moved.describe()}" if self.moved is not None else ""

    def namer(self, tokens: Sequence[int]) -> Callable[[Miss], Part] | None:
        """What names a miss of ``tokens``' lookup, if they are this request's rendered prompt."""
        r = self.rendered
        if r is None or r.n != len(tokens) or tuple(tokens[-4:]) != r.tail:
            return None
        return r.name(tokens)


def attach(request: Any, context: RequestContext) -> Any:
    """``request`` carrying ``context`` to the generation thread (a request that cannot
    carry it is refused, RuntimeError: never served unsalted). One it carries already stays."""
    if getattr(request, ATTRIBUTE, None) is None:
        try:
            setattr(request, ATTRIBUTE, context)
        except (AttributeError, TypeError) as e:
            raise RuntimeError(f"kvstore: a {type(request).__name__} cannot carry its request context ({e})") from None
    return request


def of(request: Any) -> RequestContext:
    """The context ``request`` carries; a fresh one (no salt) for a request no handler made."""
    got = getattr(request, ATTRIBUTE, None)
    return got if isinstance(got, RequestContext) else RequestContext()


class RequestTokens(SaltedTokens):
    """A prompt's tokens with the request's salt and its ``context``: what ``_tokenize``
    hands the prompt cache's lookup (slices and copies are plain ``SaltedTokens``)."""

    __slots__ = ("context",)

    def __init__(self, tokens: Iterable[int] = (), context: RequestContext | None = None) -> None:
        super().__init__(tokens, context.salt if context is not None else None)
        self.context = context

    def __reduce__(self) -> Any:  # pickled as the salted list (mlx_lm.server shares requests so)
        return (SaltedTokens, (list(self), self.salt))


def context_of(tokens: Any) -> RequestContext | None:
    """The context a lookup's ``tokens`` carry (``RequestTokens``), else None."""
    return tokens.context if isinstance(tokens, RequestTokens) else None


def name_part(tokens: Any) -> Any:
    """``LRUPromptCache.name_part`` of ``kvstore serve``: the namer of the request whose
    tokens these are."""
    ctx = context_of(tokens)
    return ctx.namer(tokens) if ctx is not None else None


def miss_note(tokens: Any) -> str:
    """``LRUPromptCache.miss_note`` of ``kvstore serve``: what ``--stable-prefix`` moved in
    the request whose tokens these are."""
    ctx = context_of(tokens)
    return ctx.note() if ctx is not None else ""


class RequestView:
    """The handler's ``response_generator`` for one request: the server's generator, whose
    ``generate`` attaches this request's context to the request it queues; all else the
    generator's own, read once per request (mlx-lm's handler reads ``cli_args`` nine times;
    nothing it reads changes while a request is handled)."""

    def __init__(self, generator: Any, context: RequestContext) -> None:
        self._generator, self.context = generator, context

    def __getattr__(self, name: str) -> Any:
        value = self.__dict__[name] = getattr(self._generator, name)
        return value

    def generate(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        return self._generator.generate(attach(request, self.context), *args, **kwargs)
