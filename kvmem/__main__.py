"""``python -m kvmem``: the ``kvmem`` command (:mod:`kvmem.cli`)."""

import sys

from kvmem.cli import main

# Guarded: `kvmem demo` starts its workers with multiprocessing's 'spawn', which imports
# this module again in each worker (as __mp_main__); there it must not run the command.
if __name__ == "__main__":
    sys.exit(main())
