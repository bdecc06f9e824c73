"""Imported last in the executors' fork server, after the task module and the supervisor's main
module (see ``supervisor.executor.preload``).

* An executor forked from it runs ``multiprocessing``'s set-up of the parent's main module again
  (``runpy.run_module``): with that module imported here already, that is a few milliseconds
  instead of every import of the CLI, and runpy's warning that the module is already imported is
  expected, so it is silenced.
* Every object held so far is moved out of the garbage collector's reach (``gc.freeze``), so that
  collecting garbage in an executor does not copy those pages (copy-on-write stays shared).
"""

import gc
import warnings

warnings.filterwarnings("ignore", message=r".*found in sys\.modules after import of package", category=RuntimeWarning)
gc.collect()
gc.freeze()
