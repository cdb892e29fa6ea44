"""cring.lightning: ``Trainer(strategy="cring")`` and ``Fabric(strategy="cring")``.

    import lightning as L
    import cring.lightning                  # registers the strategy name "cring"
    trainer = L.Trainer(strategy="cring", accelerator="gpu", devices=2)   # or "cpu"
    trainer.fit(model, datamodule=dm)

Run ``python train.py`` (the strategy starts the other processes, as DDP does),
or, with ``devices=1``, under ``cringrun -np N``, ``mpirun -np N``,
``torchrun --nproc-per-node N``, ``srun`` or Ray (one rank per process).
Under cringrun or cring.ray with more than one rank, ``Trainer()`` and
``Fabric()`` given no strategy use "cring" by themselves.

Importing this module registers "cring" with every installed Lightning
distribution: the ``lightning`` package (lightning.pytorch and lightning.fabric)
and the standalone ``pytorch_lightning`` (with lightning_fabric). One that is
already imported is registered at once; one that is installed but not yet
imported is registered the moment it is imported, so importing cring.lightning
costs no Lightning import of its own. ``import cring`` never imports this.

The classes, for the distribution in use (``lightning`` when both are there):
``CRingStrategy`` (the Trainer strategy), ``CRingFabricStrategy``,
``CRingEnvironment`` (the cluster environment); ``classes("pytorch_lightning")``
gives those of a given distribution.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import warnings
from types import SimpleNamespace
from typing import Any, Optional

try:
    import torch as _torch  # noqa: F401
except ImportError as _missing:
    raise ImportError(
        "cring.lightning needs PyTorch and Lightning; torch is not installed: "
        'pip install "cring[lightning]"'
    ) from _missing

from . import _flavors  # noqa: E402

__all__ = ["CRingEnvironment", "CRingFabricStrategy", "CRingStrategy", "classes"]

_built: dict = {}  # flavor -> SimpleNamespace of its classes
_lock = threading.RLock()
_TOP = {flavor: pkgs[0].split(".")[0] for flavor, pkgs in _flavors.FLAVORS.items()}


def classes(flavor: str = "lightning") -> SimpleNamespace:
    """cring's classes for one Lightning distribution, 'lightning' or
    'pytorch_lightning' (importing it when needed), registered as "cring" in
    its Trainer and Fabric strategy registries. Returns a namespace with
    CRingStrategy, CRingFabricStrategy and CRingEnvironment."""
    if flavor not in _flavors.FLAVORS:
        raise ValueError(
            f"unknown Lightning distribution {flavor!r}; use one of {sorted(_flavors.FLAVORS)}"
        )
    with _lock:
        found = _built.get(flavor)
        if found is not None:
            return found
        if not _flavors.installed(flavor):
            raise ImportError(
                f"{_TOP[flavor]} is not installed (pip install "
                f"{'lightning' if flavor == 'lightning' else 'pytorch-lightning'})"
            )
        from ._environment import build_environment, build_launcher
        from ._fabric import build_fabric_strategy
        from ._strategy import build_strategy

        lib = _flavors.symbols(flavor)
        environment = build_environment(lib)
        strategy = build_strategy(
            lib, environment, build_launcher(lib, lib.SubprocessScriptLauncher)
        )
        fabric_strategy = build_fabric_strategy(
            lib, environment, build_launcher(lib, lib.FabricSubprocessScriptLauncher)
        )
        strategy.register_strategies(lib.StrategyRegistry)
        fabric_strategy.register_strategies(lib.FabricRegistry)
        _auto_chooses_cring(lib.TrainerConnector, lib.FabricConnector)
        found = SimpleNamespace(
            CRingStrategy=strategy,
            CRingFabricStrategy=fabric_strategy,
            CRingEnvironment=environment,
            flavor=flavor,
        )
        _built[flavor] = found
        _hook.pending.pop(_TOP[flavor], None)
        return found


def _auto_chooses_cring(*connectors: Any) -> None:
    """strategy="auto" (Lightning's default) becomes "cring" in a job that
    cringrun, cring.run or cring.ray started with more than one rank, as
    Lightning 1.x chose Horovod under horovodrun and Lightning 2 chooses DDP
    under torchrun. A Lightning without the private method is left as it is."""
    from ._launch import choose_cring_when_launched_by_it

    for connector in connectors:
        choose = getattr(connector, "_choose_strategy", None)
        if choose is not None:
            connector._choose_strategy = choose_cring_when_launched_by_it(choose)


def _default_flavor() -> str:
    for flavor, top in _TOP.items():
        if top in sys.modules:
            return flavor
    for flavor in _TOP:
        if _flavors.installed(flavor):
            return flavor
    raise ImportError(
        'cring.lightning needs Lightning, which is not installed: pip install "cring[lightning]" '
        "(or pip install lightning, or pytorch-lightning)"
    )


def __getattr__(name: str) -> Any:
    if name in ("CRingStrategy", "CRingFabricStrategy", "CRingEnvironment"):
        return getattr(classes(_default_flavor()), name)
    raise AttributeError(f"module 'cring.lightning' has no attribute {name!r}")


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers "cring" with a Lightning distribution right after its
    top-level package has been imported (its loader's exec_module is wrapped;
    the spec itself comes from the other finders)."""

    def __init__(self) -> None:
        self.pending: dict = {}  # top-level package -> flavor

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Optional[Any]:
        flavor = self.pending.get(fullname)
        if flavor is None:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        # Patch this spec's own loader (a new one per lookup): a lookup that imports
        # nothing, such as importlib.util.find_spec(), leaves the hook in place.
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            if self.pending.get(fullname) != flavor:
                return
            try:
                classes(flavor)
            except Exception as e:  # never break the user's import
                warnings.warn(
                    f"cring.lightning could not register strategy 'cring' with {fullname}: {e!r}",
                    stacklevel=2,
                )

        loader.exec_module = exec_module
        return spec


_hook = _RegisterOnImport()


def _register_installed() -> None:
    installed = [f for f in _flavors.FLAVORS if _flavors.installed(f)]
    if not installed:
        raise ImportError(
            "cring.lightning needs Lightning, which is not installed: "
            'pip install "cring[lightning]" (or pip install lightning, or pytorch-lightning)'
        )
    for flavor in installed:
        if _TOP[flavor] in sys.modules:
            classes(flavor)
        else:
            _hook.pending[_TOP[flavor]] = flavor
    if _hook.pending and _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)


_register_installed()
