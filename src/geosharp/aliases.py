"""The public module paths of ``docs/api.md`` that name a module by its old, flat place
(``geosharp.hf``, ``geosharp.optim``, ...): each is its home module itself, imported on
first use, so that ``geosharp.hf`` and ``geosharp.loading.hf`` are one module
(monkeypatching either patches both).

>>> import geosharp.hf, geosharp.loading.hf
>>> geosharp.hf is geosharp.loading.hf
True
>>> geosharp.hf.__spec__.name
'geosharp.loading.hf'
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

ALIASES = {
    "geosharp.hf": "geosharp.loading.hf",
    "geosharp.hfdata": "geosharp.loading.hfdata",
    "geosharp.data": "geosharp.loading.data",
    "geosharp.plots": "geosharp.cli.plots",
    "geosharp.optim": "geosharp.training.optim",
    "geosharp.monitor": "geosharp.training.monitor",
    "geosharp.callbacks": "geosharp.training.callbacks",
}


class _Home(importlib.abc.Loader):
    def __init__(self, home: str):
        self.home = home

    def create_module(self, spec):
        module = importlib.import_module(self.home)
        self.spec = module.__spec__  # the import system sets the alias's over it
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.spec  # the home module ran already: keep its own spec


class _Aliases(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        home = ALIASES.get(name)
        return None if home is None else importlib.util.spec_from_loader(name, _Home(home))


def install() -> None:
    if not any(isinstance(f, _Aliases) for f in sys.meta_path):
        sys.meta_path.insert(0, _Aliases())
