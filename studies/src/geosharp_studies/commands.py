"""The studies' commands, added to the ``geosharp`` command line through the entry-point
group ``geosharp.commands``: ``geosharp study {diagonal,toy,paper,pilot}`` and
``geosharp zoo``. Each study module has ``DESCRIPTION``, ``add_arguments(parser)`` and
``run(args)``."""

from __future__ import annotations

import argparse
import importlib

STUDIES = {
    "diagonal": "geosharp_studies.diagonal",
    "toy": "geosharp_studies.toy",
    "paper": "geosharp_studies.paper",
    "pilot": "geosharp_studies.pilot",
}
ZOO = "geosharp_studies.zoo"


def _runner(module_name: str):
    def run(args: argparse.Namespace) -> int:
        return int(importlib.import_module(module_name).run(args) or 0)

    return run


def add_study(command) -> None:
    """``geosharp study NAME``."""
    study = command("study", "run a study: " + ", ".join(STUDIES))
    studies = study.add_subparsers(dest="study", required=True, metavar="STUDY")
    for name, module_name in STUDIES.items():
        module = importlib.import_module(module_name)
        p = studies.add_parser(name, help=module.DESCRIPTION, description=module.DESCRIPTION)
        module.add_arguments(p)
        p.set_defaults(run=_runner(module_name))


def add_zoo(command) -> None:
    """``geosharp zoo``: train, measure and report model zoos."""
    module = importlib.import_module(ZOO)
    zoo = command("zoo", "model zoos: train | measure | report | all", module.DESCRIPTION)
    module.add_arguments(zoo)
    zoo.set_defaults(run=_runner(ZOO))
