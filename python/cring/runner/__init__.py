"""horovod.runner's module path on cring: ``run`` is cring.run (Horovod's
``horovod.run(fn, args=(), kwargs=None, num_proc=..., ...)``, defined in
cring._run_api, the same object). Horovod's runner internals
(horovod.runner.common, .http, .elastic, .gloo_run, ...) have no counterpart:
cringrun is the launcher (cring.launch)."""

from .._run_api import RunError, run

__all__ = ["RunError", "run"]
