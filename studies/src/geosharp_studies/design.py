"""Population designs in which the question is the only thing that varies.

:func:`star_design` builds a hyperparameter population with exact one-axis pairs: each
base configuration, plus one variant per alternative value of each axis, differing
from its base in that axis alone. Jiang et al.'s granulated Kendall tau is then
computed as defined, within the groups {base, its variants along one axis}
(:func:`geosharp_studies.stats.grouped_granulated_tau`), and its uncertainty by a
bootstrap over base configurations (:func:`~geosharp_studies.stats.granulated_tau_ci`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["star_design"]


def star_design(
    bases: Sequence[Mapping], alternatives: Mapping[str, Sequence]
) -> tuple[list[dict], list[dict[str, list[int]]]]:
    """The configurations of a star design and its groups.

    Returns ``(configs, groups_by_base)``: ``configs`` lists every base followed by its
    variants (each config records ``base`` and the ``varied`` axis, ``None`` for the
    base); ``groups_by_base[b][axis]`` holds the indices of base ``b`` and of its
    variants along ``axis``. An alternative equal to the base's own value is skipped.

    >>> configs, groups = star_design([{"lr": 1, "wd": 0}], {"lr": [1, 2, 3], "wd": [0.1]})
    >>> [(c["lr"], c["wd"], c["varied"]) for c in configs]
    [(1, 0, None), (2, 0, 'lr'), (3, 0, 'lr'), (1, 0.1, 'wd')]
    >>> groups
    [{'lr': [0, 1, 2], 'wd': [0, 3]}]
    """
    configs: list[dict] = []
    groups_by_base: list[dict[str, list[int]]] = []
    for b, base in enumerate(bases):
        missing = set(alternatives) - set(base)
        if missing:
            raise ValueError(f"base configuration {b} has no value for {sorted(missing)}")
        root = len(configs)
        configs.append({**base, "base": b, "varied": None})
        groups: dict[str, list[int]] = {}
        for axis, values in alternatives.items():
            members = [root]
            for value in values:
                if value == base[axis]:
                    continue
                members.append(len(configs))
                configs.append({**base, axis: value, "base": b, "varied": axis})
            if len(members) > 1:
                groups[axis] = members
        groups_by_base.append(groups)
    return configs, groups_by_base
