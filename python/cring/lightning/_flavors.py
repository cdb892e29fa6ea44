# The two Lightning distributions: the `lightning` package (lightning.pytorch +
# lightning.fabric) and the standalone `pytorch_lightning` + `lightning_fabric`.
# Their classes are distinct, so cring builds its strategy classes once per
# distribution, from the symbols collected here. Nothing is imported until asked.
"""Which Lightning distributions exist, and the symbols cring's classes need from each."""

from __future__ import annotations

import importlib
import importlib.util
from types import SimpleNamespace

# distribution -> (trainer package, fabric package)
FLAVORS = {
    "lightning": ("lightning.pytorch", "lightning.fabric"),
    "pytorch_lightning": ("pytorch_lightning", "lightning_fabric"),
}


def installed(flavor: str) -> bool:
    top = FLAVORS[flavor][0].split(".")[0]
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def symbols(flavor: str) -> SimpleNamespace:
    """Import one distribution and collect what cring's classes use from it."""
    trainer_pkg, fabric_pkg = FLAVORS[flavor]

    def mod(name: str):
        return importlib.import_module(name)

    envs = mod(f"{fabric_pkg}.plugins.environments")
    pl_strategies = mod(f"{trainer_pkg}.strategies")
    fabric_strategies = mod(f"{fabric_pkg}.strategies")
    import lightning_utilities.core.rank_zero as utils_rank_zero

    return SimpleNamespace(
        flavor=flavor,
        trainer_pkg=trainer_pkg,
        fabric_pkg=fabric_pkg,
        ClusterEnvironment=envs.ClusterEnvironment,
        # what Lightning picks by itself; cring's environment understands all of them
        auto_environments=(
            envs.LightningEnvironment,
            envs.TorchElasticEnvironment,
            envs.SLURMEnvironment,
            envs.MPIEnvironment,
        ),
        find_free_network_port=mod(
            f"{fabric_pkg}.plugins.environments.lightning"
        ).find_free_network_port,
        # what Trainer(strategy="auto") and Fabric(strategy="auto") ask for their choice
        TrainerConnector=getattr(
            mod(f"{trainer_pkg}.trainer.connectors.accelerator_connector"),
            "_AcceleratorConnector",
            None,
        ),
        FabricConnector=getattr(mod(f"{fabric_pkg}.connector"), "_Connector", None),
        ParallelStrategy=pl_strategies.ParallelStrategy,
        StrategyRegistry=pl_strategies.StrategyRegistry,
        SubprocessScriptLauncher=mod(
            f"{trainer_pkg}.strategies.launchers.subprocess_script"
        )._SubprocessScriptLauncher,
        FabricParallelStrategy=fabric_strategies.ParallelStrategy,
        FabricRegistry=fabric_strategies.STRATEGY_REGISTRY,
        FabricSubprocessScriptLauncher=mod(
            f"{fabric_pkg}.strategies.launchers.subprocess_script"
        )._SubprocessScriptLauncher,
        launch_process_observer=mod(
            f"{fabric_pkg}.strategies.launchers.subprocess_script"
        )._launch_process_observer,
        set_num_threads_if_needed=mod(
            f"{fabric_pkg}.utilities.distributed"
        )._set_num_threads_if_needed,
        reset_seed=mod(f"{fabric_pkg}.utilities.seed").reset_seed,
        optimizers_to_device=mod(f"{fabric_pkg}.utilities.optimizer")._optimizers_to_device,
        TrainerFn=mod(f"{trainer_pkg}.trainer.states").TrainerFn,
        rank_zero_only=mod(f"{trainer_pkg}.utilities.rank_zero").rank_zero_only,
        fabric_rank_zero_only=mod(f"{fabric_pkg}.utilities.rank_zero").rank_zero_only,
        utils_rank_zero_only=utils_rank_zero.rank_zero_only,
    )
