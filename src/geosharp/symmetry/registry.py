"""The handler registry: which function finds the ``(G, H)`` pairs of which module.

A handler is ``handler(module, prefix, name_of) -> list[PairSpec]`` where ``name_of``
maps a parameter tensor of the model to its name. Handlers are looked up by the
module's class (exact class or qualified class name, so ``transformers`` and ``peft``
are never imported for it), then by structural matchers (:func:`register_matcher`).
The built-in handlers (:mod:`.handlers`, :mod:`.peft_handlers`) register themselves
when :mod:`geosharp.symmetry` is imported; register your own with
:func:`register_handler` for a layout the trace cannot see (a fused kernel, a custom
autograd function). Declared pairs are verified like traced ones, and win over them.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from .pairs import PairSpec

__all__ = ["handler_for", "nested_pairs", "register_handler", "register_matcher"]

NameOf = Callable[[Tensor], str]
Handler = Callable[[nn.Module, str, NameOf], list[PairSpec]]
Matcher = Callable[[nn.Module], bool]

_HANDLERS: dict[type | str, Handler] = {}
_MATCHERS: list[tuple[Matcher, Handler]] = []


def register_handler(cls: type | str, handler: Handler) -> None:
    """Declare how to find the pairs of modules of class ``cls``.

    ``cls`` is a class or its qualified name (``"package.module.ClassName"``).
    The handler's pairs replace the default element-wise treatment of the module's
    parameters; descendants of a handled module are not visited (call
    :func:`nested_pairs` in the handler to include pairs of handled descendants,
    such as LoRA adapters).
    """
    _HANDLERS[cls] = handler


def register_matcher(matches: Matcher, handler: Handler) -> None:
    """Declare a handler for every module for which ``matches(module)`` is true (tried
    after the class registry, in registration order)."""
    _MATCHERS.append((matches, handler))


def handler_for(module: nn.Module) -> Handler | None:
    cls = type(module)
    if cls in _HANDLERS:
        return _HANDLERS[cls]
    by_name = _HANDLERS.get(f"{cls.__module__}.{cls.__qualname__}")
    if by_name is not None:
        return by_name
    for matches, handler in _MATCHERS:
        if matches(module):
            return handler
    return None


def nested_pairs(module: nn.Module, prefix: str, name_of: NameOf) -> list[PairSpec]:
    """Pairs of the handled descendants of ``module`` (not ``module`` itself), e.g. the
    LoRA adapters inside an attention layer; descendants of those are not visited."""
    out: list[PairSpec] = []
    done: list[str] = []
    for name, child in module.named_modules():
        if not name or any(name == d or name.startswith(d + ".") for d in done):
            continue
        handler = handler_for(child)
        if handler is not None:
            out.extend(handler(child, f"{prefix}.{name}" if prefix else name, name_of))
            done.append(name)
    return out
