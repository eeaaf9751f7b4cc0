"""Auto-PGD with the reference's restart, for comparison: the best point's gradient kept
(one parameter-sized vector more) and stepped from at once, where geosharp evaluates the
best point again (``geosharp.measures.apgd``'s docstring)."""

from __future__ import annotations

import contextlib
import functools
from unittest import mock


def restart_rule(kept_gradient: bool):
    """A context in which :func:`geosharp.sharpness` restarts as the reference does
    (``kept_gradient``), or geosharp's own (a null context)."""
    if not kept_gradient:
        return contextlib.nullcontext()
    from geosharp.measures import apgd, estimators

    reference = functools.partial(apgd.auto_pgd, keep_best_gradient=True)
    return mock.patch.object(estimators, "auto_pgd", reference)


KEPT = "kept gradient"
"""The name results record for the reference's rule (geosharp's own:
:data:`geosharp.measures.apgd.RESTART`)."""


def rule_name(kept_gradient: bool) -> str:
    from geosharp.measures.apgd import RESTART

    return KEPT if kept_gradient else RESTART
