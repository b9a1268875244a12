"""Prism's patch for Python processes a rank spawns (see prism.rank.bootstrap).

Put on ``PYTHONPATH`` by the fork server. Does nothing unless
``PRISM_COORDINATOR`` is set, and patches only once the process itself has
imported torch (fully: patching halfway through torch's own import fails), so
helper processes that never import torch stay cheap.
"""

import os
import sys

if os.environ.get("PRISM_COORDINATOR"):
    import importlib.abc

    class _PatchWhenLoaded(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != "torch":
                return None
            sys.meta_path.remove(self)
            try:
                import importlib.util

                spec = importlib.util.find_spec(fullname)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            loader = spec.loader
            exec_module = loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
                from prism.rank.bootstrap import install_lazy

                install_lazy()

            loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, _PatchWhenLoaded())
